"""The floor under a gateway's CPU per relayed token: what uvicorn alone costs to stream one SSE chunk, with nothing
of Switchyard in the way, so bench/streams.py's figure splits into the server stack's share and ours.

    .venv/bin/python bench/sse_floor.py                        # 1,000 streams at 20 chunks/s, each stack
    .venv/bin/python bench/sse_floor.py --streams 2000 --wrappers 0 6

The server is uvicorn with a bare ASGI app, in a process of its own: each request gets a response start, then a
chunk the size of a chat completion chunk every 1/R seconds (each stream its own timer, as a relayed stream wakes
once per delta), optionally through ``--wrappers`` pure-ASGI middlewares that wrap ``send`` as the gateway's do.
The client reads raw sockets and throws the bytes away, so the two cores are the server's more than the client's.
Reported per configuration (event loop x HTTP implementation x wrappers): the server's CPU microseconds per chunk,
and the chunks per second it sent.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, lscpu  # noqa: E402
from bench.proc import cpu_seconds  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402

# About the size of one streamed chat chunk of the gateway (one word of content, include_usage on).
CHUNK = (b'data: {"id":"chatcmpl-0123456789abcdef0123456789abcdef","object":"chat.completion.chunk","created":'
         b'1764300000,"model":"sim-20","system_fingerprint":null,"choices":[{"index":0,"delta":{"content":" amber"},'
         b'"logprobs":null,"finish_reason":null}],"usage":null}\n\n')


def _app(rate: float, num_chunks: int):
    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for _ in range(num_chunks):
            await asyncio.sleep(1 / rate)
            await send({"type": "http.response.body", "body": CHUNK, "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})
    return app


def _wrapped(app, depth: int):
    """``app`` under ``depth`` middlewares that each wrap ``send`` (as a header-adding middleware does)."""
    for _ in range(depth):
        def layer(inner):
            async def middleware(scope, receive, send) -> None:
                async def wrapped_send(message) -> None:
                    await send(message)
                await inner(scope, receive, wrapped_send)
            return middleware
        app = layer(app)
    return app


def serve(port: int, loop: str, http: str, wrappers: int, rate: float, num_chunks: int) -> None:
    import uvicorn

    uvicorn.run(_wrapped(_app(rate, num_chunks), wrappers), host="127.0.0.1", port=port, loop=loop, http=http,
                log_level="error", access_log=False, backlog=4096)


async def _read_stream(port: int, delay_s: float) -> int:
    await asyncio.sleep(delay_s)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
    received = 0
    while data := await reader.read(65536):
        received += len(data)
        if data.endswith(b"0\r\n\r\n"):  # the chunked body's end
            break
    writer.close()
    return received


def _client(port: int, streams: int, ramp_s: float, out) -> None:
    async def run() -> list[int]:
        return await asyncio.gather(*(_read_stream(port, ramp_s * i / streams) for i in range(streams)))
    out.send(sum(asyncio.run(run())))


def _wait_listening(port: int, timeout_s: float = 30) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError("the server did not start")


def measure(loop: str, http: str, wrappers: int, args) -> dict:
    from tests.support.system import free_port

    port = free_port()
    ctx = multiprocessing.get_context("spawn")
    num_chunks = int(args.rate * (args.seconds + args.ramp))
    server = ctx.Process(target=serve, args=(port, loop, http, wrappers, args.rate, num_chunks), daemon=True)
    server.start()
    try:
        _wait_listening(port)
        cpu_before, started = cpu_seconds(server.pid), time.perf_counter()
        pipes, clients = [], []
        for i in range(args.clients):
            recv, send = ctx.Pipe(duplex=False)
            share = args.streams // args.clients + (i < args.streams % args.clients)
            proc = ctx.Process(target=_client, args=(port, share, args.ramp, send))
            proc.start()
            send.close()
            pipes.append(recv)
            clients.append(proc)
        received = sum(pipe.recv() for pipe in pipes)
        wall, cpu = time.perf_counter() - started, cpu_seconds(server.pid) - cpu_before
        for proc in clients:
            proc.join()
    finally:
        server.terminate()
        server.join(10)
    chunks = received / len(CHUNK)  # close enough: headers and framing are a few percent of it
    return {"loop": loop, "http": http, "wrappers": wrappers, "us_per_chunk": 1e6 * cpu / max(1.0, chunks),
            "chunks_per_s": chunks / wall, "server_cpu": cpu / wall}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, default=1000)
    p.add_argument("--rate", type=float, default=20.0, help="chunks a second per stream")
    p.add_argument("--seconds", type=float, default=15.0, help="how long the streams are all open together")
    p.add_argument("--ramp", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=1, help="client processes")
    p.add_argument("--loops", nargs="+", default=["asyncio", "uvloop"])
    p.add_argument("--https", nargs="+", default=["h11", "httptools"])
    p.add_argument("--wrappers", type=int, nargs="+", default=[0, 6],
                   help="send-wrapping middlewares (the gateway's streams pass about six)")
    p.add_argument("--results", default=str(RESULTS), help="'-' to skip")
    args = p.parse_args()
    cpu = cpu_name(lscpu())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    rows = []
    for loop in args.loops:
        for http in args.https:
            for wrappers in args.wrappers:
                row = measure(loop, http, wrappers, args)
                print(row, flush=True)
                rows.append(row)
    table = markdown_table(("event loop", "HTTP", "send wrappers", "server us / chunk", "chunks/s", "server CPU"),
                           [(r["loop"], r["http"], r["wrappers"], f"{r['us_per_chunk']:.1f}",
                             f"{r['chunks_per_s']:.0f}", f"{r['server_cpu']:.0%}") for r in rows])
    text = (f"## SSE floor: uvicorn alone, per streamed chunk, {cpu}, {os.cpu_count()} cores\n\n"
            f"`{command_line()}`: {args.streams} streams at {args.rate:g} chunks/s of {len(CHUNK)} bytes, all open "
            f"for {args.seconds:g} s, a raw-socket client in {args.clients} process(es).\n\n{table}\n")
    print(text)
    append_section(text, args.results)


if __name__ == "__main__":
    main()
