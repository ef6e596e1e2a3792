"""The clients of bench/tenants.py, in processes of their own: the light tenant's paced requests (their TTFT is the
measure), and closed loops (one stream after another) for the heavy tenant and every active tenant."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

LIGHT_EVERY_S = 2.0


@dataclass
class LoadReport:
    light_ttfts: list[float] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)  # role -> requests completed
    failed: int = 0
    errors: list[str] = field(default_factory=list)

    @staticmethod
    def merged(reports: list[LoadReport]) -> LoadReport:
        out = LoadReport()
        for r in reports:
            out.light_ttfts += r.light_ttfts
            out.failed += r.failed
            out.errors += r.errors[:3]
            for role, n in r.served.items():
                out.served[role] = out.served.get(role, 0) + n
        return out

    def light_ttft(self, q: float) -> float:
        values = sorted(self.light_ttfts) or [float("nan")]
        return values[min(len(values) - 1, int(len(values) * q / 100))]

    def served_line(self) -> str:
        return " / ".join(str(self.served.get(role, 0)) for role in ("light", "heavy", "active"))

    def summary(self) -> str:
        return (f"light TTFT p50 {self.light_ttft(50):.3f} s p95 {self.light_ttft(95):.3f} s, served "
                f"{self.served_line()}, failed {self.failed} {self.errors[:2]}")


async def _stream(client, model: str, key: str, tokens: int) -> float:
    """One streamed chat; its time to first content (raises on any failure)."""
    sent = time.perf_counter()
    first = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=tokens, stream=True,
        extra_headers={"Authorization": f"Bearer {key}"})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - sent
    if first is None:
        raise RuntimeError("no content")
    return first


async def _load(base_url: str, model: str, tokens: int, light_tokens: int, keys: dict[str, list[str]],
                seconds: float) -> LoadReport:
    import httpx
    from openai import AsyncOpenAI

    report = LoadReport(served={role: 0 for role in keys})
    end = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="per-request", max_retries=0,
                         http_client=httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=120)))

    async def once(role: str, key: str) -> float | None:
        try:
            ttft = await _stream(client, model, key, light_tokens if role == "light" else tokens)
        except Exception as exc:  # noqa: BLE001 - counted: a failure is a result
            report.failed += 1
            report.errors.append(f"{role}: {type(exc).__name__}: {str(exc)[:120]}")
            return None
        report.served[role] += 1
        return ttft

    async def closed_loop(role: str, key: str) -> None:
        while time.perf_counter() < end:
            await once(role, key)

    async def paced(key: str) -> None:
        async def timed() -> None:
            ttft = await once("light", key)
            if ttft is not None:
                report.light_ttfts.append(ttft)

        tasks = []
        while time.perf_counter() < end:
            tasks.append(asyncio.create_task(timed()))
            await asyncio.sleep(LIGHT_EVERY_S)
        await asyncio.gather(*tasks)

    try:
        loops = [closed_loop(role, key) for role, ks in keys.items() if role != "light" for key in ks]
        await asyncio.gather(*loops, *(paced(key) for key in keys.get("light", [])))
    finally:
        await client.close()
    return report


def run_load(base_url: str, model: str, tokens: int, light_tokens: int, keys: dict[str, list[str]], seconds: float,
             out) -> None:
    """A client process's body; its report through ``out`` (a multiprocessing connection)."""
    out.send(asyncio.run(_load(base_url, model, tokens, light_tokens, keys, seconds)))
    out.close()
