"""The client side of bench/burst.py, in processes of their own so that their CPU is not the platform's.

Each process opens its share of the burst's streams at one agreed moment (``start_at``, wall clock: every process
waits for it). A burst's clients share the machine with the platform, so each stream is one connection speaking
just enough HTTP/1.1 over asyncio streams (uvloop where installed): the request written in one piece, the chunked
SSE answer read chunk by chunk, only what is measured parsed (the first content, the final usage). httpx, tried
first, spent about 14 ms of CPU a stream here, as much as the gateway; this spends under 1 ms.

Per stream: whether it completed, its time to first content counted from ``start_at`` (what a client of a burst
waits, its own connect included), its request id (``X-Request-Id``: the usage row says when the gateway accepted
it and how long it queued), and the process's CPU.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import resource
import time
from dataclasses import dataclass
from urllib.parse import urlsplit

_FIRST_CONTENT = re.compile(rb'"delta":\{[^}]*"content":"[^"]')  # a delta with some content (not the role's "")
_COMPLETION_TOKENS = re.compile(rb'"usage":\{[^}]*"completion_tokens":(\d+)')


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


async def _one(host: str, port: int, key: str, model: str, max_tokens: int, start_at: float,
               content: str) -> BurstResult:
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                       "stream": True, "stream_options": {"include_usage": True}}).encode()
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {key}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    first = None
    tokens = 0
    request_id = ""
    writer = None
    try:
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(head + body)
        status_line = await reader.readline()
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        request_id = headers.get("x-request-id", "")
        if b" 200 " not in status_line:
            text = (await reader.read(400)).decode(errors="replace")
            return BurstResult(False, request_id=request_id, error=f"{status_line.decode().strip()}: {text[:200]}")
        if headers.get("transfer-encoding") != "chunked":
            return BurstResult(False, request_id=request_id, error=f"not chunked: {headers}")
        while True:
            size = int((await reader.readline()).split(b";", 1)[0], 16)
            chunk = await reader.readexactly(size + 2)  # with its CRLF
            if size == 0:
                break
            if first is None and _FIRST_CONTENT.search(chunk):
                first = time.time()
            if (m := _COMPLETION_TOKENS.search(chunk)) is not None:
                tokens = int(m.group(1))
    except Exception as exc:  # noqa: BLE001 - a failed stream is a result of the benchmark, not its end
        return BurstResult(False, request_id=request_id, error=f"{type(exc).__name__}: {str(exc)[:200]}")
    finally:
        if writer is not None:
            writer.close()
    end = time.time()
    if first is None or tokens != max_tokens:
        return BurstResult(False, request_id=request_id, error=f"ended with {tokens} of {max_tokens} tokens")
    return BurstResult(True, first - start_at, end - start_at, request_id)


async def _run(base_url: str, keys: list[str], model: str, count: int, max_tokens: int, start_at: float,
               seed: int) -> list[BurstResult]:
    url = urlsplit(base_url)
    host, port = url.hostname or "127.0.0.1", url.port or 80
    await asyncio.sleep(max(0.0, start_at - time.time()))
    return await asyncio.gather(*(
        _one(host, port, keys[i % len(keys)], model, max_tokens, start_at, f"burst {seed}-{i}: tell me a story")
        for i in range(count)))


def run_burst(base_url: str, keys: list[str], model: str, count: int, max_tokens: int, start_at: float, seed: int,
              out, nice: int = 0) -> None:
    """A client process's body: ``count`` streams opened at ``start_at``, then its report through ``out`` (a
    multiprocessing connection). ``nice``: how much less of the CPU it asks for than the platform."""
    os.nice(nice)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    start = resource.getrusage(resource.RUSAGE_SELF)
    run = _run(base_url, keys, model, count, max_tokens, start_at, seed)
    results = uvloop.run(run) if uvloop is not None else asyncio.run(run)
    end = resource.getrusage(resource.RUSAGE_SELF)
    out.send(BurstReport(results, (end.ru_utime - start.ru_utime) + (end.ru_stime - start.ru_stime)))
    out.close()
