"""The clients of bench/tenants.py, in processes of their own: the light tenant's paced requests (their TTFT is the
measure), and closed loops (one stream after another) for the heavy tenant and every active tenant.

The light tenant's requests are told apart by when they were sent: during the first round (before every active
tenant has had its first request started, all of them arriving at once, and until the light tenant's own requests
queued meanwhile are served) or after it, in the steady state. In the
first round a thousand tenants that have had nothing rank before one that has had a little (fair share orders by
service received); after it, the light tenant is the least served whenever it comes back."""

from __future__ import annotations

import asyncio
import os
import random
import time
from dataclasses import dataclass, field

LIGHT_EVERY_S = 2.0
# An active or heavy tenant's request asks for --tokens times a factor drawn from this range: requests of one length,
# all started at once, would end at once too, and the seats would free in bursts a request's length apart (a
# light tenant then waits for the next burst whatever the scheduler does); real requests vary.
LENGTH_SPREAD = (0.5, 1.5)


@dataclass
class LoadReport:
    # Per light request: (sent at, wall clock; TTFT; its request id, for its usage row)
    light: list[tuple[float, float, str]] = field(default_factory=list)
    served: dict[str, int] = field(default_factory=dict)  # role -> requests completed
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    # When the last active tenant got its first token (wall clock): the end of the first round. None: no active
    # tenant, or one never served.
    first_round_end: float | None = None
    unserved_active: int = 0  # active tenants whose first request never got a token
    started_at: float = 0.0  # when the load began (wall clock), and for how long it ran
    seconds: float = 0.0

    @staticmethod
    def merged(reports: list[LoadReport]) -> LoadReport:
        out = LoadReport()
        for r in reports:
            out.light += r.light
            out.failed += r.failed
            out.errors += r.errors[:3]
            out.unserved_active += r.unserved_active
            out.started_at = min(out.started_at or r.started_at, r.started_at)
            out.seconds = max(out.seconds, r.seconds)
            if r.first_round_end is not None:
                out.first_round_end = max(out.first_round_end or 0.0, r.first_round_end)
            for role, n in r.served.items():
                out.served[role] = out.served.get(role, 0) + n
        return out

    def settled_at(self) -> float:
        """When the steady state begins: the first round over, and the light tenant's own requests queued during
        it served (a request of its sent just after the round waits behind its own earlier ones, not the others')."""
        end = self.first_round_end if self.first_round_end is not None else float("inf")
        return max([end] + [sent + ttft for sent, ttft, _ in self.light if sent < end])

    def _phase(self, phase: str) -> list[float]:
        """TTFTs of the light tenant's requests sent in ``phase``: "all", "first" (the first round and its
        backlog), "steady" (after ``settled_at``) or "late" (in the load's second half: past the first round, and
        past the light tenant's own backlog from it, which fair share charged to it, twenty requests served at once:
        until the others have caught up, it ranks behind some of them)."""
        return sorted(ttft for sent, ttft, _ in self.light_requests(phase))

    def light_requests(self, phase: str) -> list[tuple[float, float, str]]:
        """The light tenant's requests sent in ``phase`` (see ``_phase``)."""
        if phase == "late":
            return [r for r in self.light if r[0] >= self.started_at + self.seconds / 2]
        settled = self.settled_at()
        return [r for r in self.light if phase == "all" or (r[0] < settled) == (phase == "first")]

    def light_ttft(self, q: float, phase: str = "all") -> float:
        """The light tenant's TTFT percentile ``q`` over its requests sent in ``phase`` (see ``_phase``)."""
        values = self._phase(phase) or [float("nan")]
        return values[min(len(values) - 1, int(len(values) * q / 100))]

    def light_count(self, phase: str) -> int:
        return len(self._phase(phase))

    def served_line(self) -> str:
        return " / ".join(str(self.served.get(role, 0)) for role in ("light", "heavy", "active"))

    def summary(self) -> str:
        return (f"light TTFT p50 {self.light_ttft(50):.3f} s p95 {self.light_ttft(95):.3f} s, served "
                f"{self.served_line()}, failed {self.failed} {self.errors[:2]}")


async def _stream(client, model: str, key: str, tokens: int, on_first=None) -> tuple[float, str]:
    """One streamed chat: its time to first content and its request id (raises on any failure). ``on_first()``
    runs at the first content."""
    sent = time.perf_counter()
    first = None
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "hello"}], max_tokens=tokens, stream=True,
        extra_headers={"Authorization": f"Bearer {key}"})
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - sent
            if on_first is not None:
                on_first()
    if first is None:
        raise RuntimeError("no content")
    return first, chunk.id.removeprefix("chatcmpl-")


async def _load(base_url: str, model: str, tokens: int, light_tokens: int, keys: dict[str, list[str]],
                seconds: float) -> LoadReport:
    import httpx
    from openai import AsyncOpenAI

    report = LoadReport(served={role: 0 for role in keys}, started_at=time.time(), seconds=seconds)
    lengths = random.Random(len(keys.get("active", ())))  # the same lengths run after run
    end = time.perf_counter() + seconds
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    client = AsyncOpenAI(base_url=f"{base_url}/v1", api_key="per-request", max_retries=0,
                         http_client=httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=120)))

    async def once(role: str, key: str, on_first=None) -> tuple[float, str] | None:
        try:
            wanted = light_tokens if role == "light" else max(1, round(tokens * lengths.uniform(*LENGTH_SPREAD)))
            answer = await _stream(client, model, key, wanted, on_first)
        except Exception as exc:  # noqa: BLE001 - counted: a failure is a result
            report.failed += 1
            report.errors.append(f"{role}: {type(exc).__name__}: {str(exc)[:120]}")
            # As the official client would (its retries are off here, to count each failure): wait what the server
            # asked, so one refusal is not a storm of them.
            response = getattr(exc, "response", None)
            await asyncio.sleep(float(response.headers.get("retry-after", 1)) if response is not None else 1.0)
            return None
        report.served[role] += 1
        return answer

    first_tokens: list[float] = []  # wall clock of each active tenant's first token

    async def closed_loop(role: str, key: str) -> None:
        if role == "active":
            await once(role, key, lambda: first_tokens.append(time.time()))
        while time.perf_counter() < end:
            await once(role, key)

    async def paced(key: str) -> None:
        async def timed() -> None:
            sent = time.time()
            answer = await once("light", key)
            if answer is not None:
                report.light.append((sent, *answer))

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
    active = len(keys.get("active", ()))
    report.unserved_active = active - len(first_tokens)
    if active:  # a tenant never served: the first round never ended
        report.first_round_end = max(first_tokens) if first_tokens and not report.unserved_active else float("inf")
    return report


def run_load(base_url: str, model: str, tokens: int, light_tokens: int, keys: dict[str, list[str]], seconds: float,
             out, nice: int = 0) -> None:
    """A client process's body; its report through ``out`` (a multiprocessing connection). ``nice``: added to the
    process's nice value first (load generators that stand for clients on other machines)."""
    if nice:
        os.nice(nice)
    out.send(asyncio.run(_load(base_url, model, tokens, light_tokens, keys, seconds)))
    out.close()
