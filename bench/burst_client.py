"""The client side of bench/burst.py, in processes of their own so that their CPU is not the platform's.

Each process opens its share of the burst's streams at one agreed moment (``start_at``, wall clock: every process
waits for it), as raw streamed ``POST /v1/chat/completions`` over httpx rather than through the ``openai`` client:
a burst's clients share the machine with the platform, and parsing only what is measured (the first content, the
final usage) leaves the platform more of it. Per stream: whether it completed, its time to first content counted
from ``start_at`` (what a client of a burst waits, its own connect included), its request id (``X-Request-Id``:
the usage row says when the gateway accepted it and how long it queued), and the process's CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
import time
from dataclasses import dataclass


@dataclass
class BurstResult:
    ok: bool
    ttft_s: float = 0.0  # from start_at to the first content
    end_s: float = 0.0  # from start_at to the stream's end
    request_id: str = ""
    error: str = ""


@dataclass
class BurstReport:
    results: list[BurstResult]
    cpu_s: float  # this process's user + system CPU over the burst


async def _one(http, key: str, model: str, max_tokens: int, start_at: float, content: str) -> BurstResult:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}}
    first = None
    tokens = 0
    request_id = ""
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as response:
            request_id = response.headers.get("x-request-id", "")
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                return BurstResult(False, request_id=request_id, error=f"{response.status_code}: {text[:200]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                if first is None and '"content":' in line:
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                        first = time.time()
                elif '"usage":{' in line:
                    tokens = json.loads(line[6:])["usage"]["completion_tokens"]
    except Exception as exc:  # noqa: BLE001 - a failed stream is a result of the benchmark, not its end
        return BurstResult(False, request_id=request_id, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    end = time.time()
    if first is None or tokens != max_tokens:
        return BurstResult(False, request_id=request_id, error=f"ended with {tokens} of {max_tokens} tokens")
    return BurstResult(True, first - start_at, end - start_at, request_id)


async def _run(base_url: str, keys: list[str], model: str, count: int, max_tokens: int, start_at: float,
               seed: int) -> list[BurstResult]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, limits=limits,
                                 timeout=httpx.Timeout(600, connect=120)) as http:
        await asyncio.sleep(max(0.0, start_at - time.time()))
        return await asyncio.gather(*(
            _one(http, keys[i % len(keys)], model, max_tokens, start_at, f"burst {seed}-{i}: tell me a story")
            for i in range(count)))


def run_burst(base_url: str, keys: list[str], model: str, count: int, max_tokens: int, start_at: float, seed: int,
              out, nice: int = 0) -> None:
    """A client process's body: ``count`` streams opened at ``start_at``, then its report through ``out`` (a
    multiprocessing connection). ``nice``: how much less of the CPU it asks for than the platform."""
    os.nice(nice)
    start = resource.getrusage(resource.RUSAGE_SELF)
    results = asyncio.run(_run(base_url, keys, model, count, max_tokens, start_at, seed))
    end = resource.getrusage(resource.RUSAGE_SELF)
    out.send(BurstReport(results, (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)))
    out.close()
