"""The client side of bench/streams.py, in processes of its own so that its CPU is not the gateway's.

Each process opens its share of a step's streams through the official ``openai`` client (async, streaming,
``stream_options.include_usage``), started evenly over the ramp and each lasting until ``hold_s`` after it (the
step's streams are all open together for that long, however long the ramp), and reports per stream: whether it
completed, its time to first content, its largest and a sample of its inter-chunk gaps, and its tokens; plus its
own CPU time.
"""

from __future__ import annotations

import asyncio
import os
import random
import resource
import time
from dataclasses import dataclass, field


@dataclass
class StreamResult:
    ok: bool
    ttft_s: float = 0.0
    tokens: int = 0
    max_gap_s: float = 0.0
    gaps_s: list[float] = field(default_factory=list)  # a sample: at most GAP_SAMPLES per stream
    error: str = ""


GAP_SAMPLES = 20


@dataclass
class ClientReport:
    results: list[StreamResult]
    cpu_s: float  # this process's user + system CPU over the step


async def _one(client, model: str, max_tokens: int, delay_s: float, content: str) -> StreamResult:
    await asyncio.sleep(delay_s)
    sent = time.perf_counter()
    first = last = None
    gaps: list[float] = []
    max_gap, seen, tokens = 0.0, 0, 0
    rng = random.Random(content)
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": content}], max_tokens=max_tokens, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            if not (chunk.choices and chunk.choices[0].delta.content):
                continue
            now = time.perf_counter()
            if first is None:
                first = now
            else:
                gap = now - last
                max_gap = max(max_gap, gap)
                seen += 1
                if len(gaps) < GAP_SAMPLES:  # reservoir sample of the gaps
                    gaps.append(gap)
                elif (j := rng.randrange(seen)) < GAP_SAMPLES:
                    gaps[j] = gap
            last = now
    except Exception as exc:  # noqa: BLE001 - a failed stream is a result of the benchmark, not its end
        return StreamResult(False, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    if first is None or tokens != max_tokens:
        return StreamResult(False, error=f"ended with {tokens} of {max_tokens} tokens")
    return StreamResult(True, first - sent, tokens, max_gap, gaps)


async def _run(base_url: str, keys: list[str], model: str, num_streams: int, rate: float, hold_s: float,
               ramp_s: float, seed: int) -> list[StreamResult]:
    import httpx
    from openai import AsyncOpenAI

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    clients = [AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0,
                           http_client=httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(600, connect=120)))
               for key in keys]
    try:
        delays = [ramp_s * i / max(1, num_streams) for i in range(num_streams)]
        return await asyncio.gather(*(
            _one(clients[i % len(clients)], model, max(1, round(rate * (hold_s + ramp_s - delay))), delay,
                 f"stream {seed}-{i}: tell me a story") for i, delay in enumerate(delays)))
    finally:
        for client in clients:
            await client.close()


def run_client(base_url: str, keys: list[str], model: str, num_streams: int, rate: float, hold_s: float,
               ramp_s: float, seed: int, out, nice: int = 0) -> None:
    """A client process's body: its streams, then its report through ``out`` (a multiprocessing connection).
    ``nice``: how much less of the CPU it asks for than the platform (a client on another machine asks none)."""
    os.nice(nice)
    start = resource.getrusage(resource.RUSAGE_SELF)
    results = asyncio.run(_run(base_url, keys, model, num_streams, rate, hold_s, ramp_s, seed))
    end = resource.getrusage(resource.RUSAGE_SELF)
    out.send(ClientReport(results, (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)))
    out.close()
