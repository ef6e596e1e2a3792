"""What one request costs apart from its tokens, the model taken out: the gateway's CPU and socket writes and
reads, and the statements every process sends Postgres for it, counted and named. The figures size gateways and
Postgres for a deployment (README, Scaling): requests/s times these.

    .venv/bin/python bench/request_cost.py
    .venv/bin/python bench/request_cost.py --requests 1000 --results -

A system on embedded servers with the simulated engine (workers/simulated_engine.py, a test double) serves one key
chat completions (with ``include_usage``) and responses (stored, as by default) of 1 and of 4 tokens, streamed,
``--concurrency`` at a time:

* the gateway's CPU per request and its socket writes and reads per request (``/proc/<pid>/io``: ``syscw``,
  ``syscr``; HTTP, NATS and Postgres together): each write is a system call, which on a virtual machine costs
  more than the Python around it;
* Postgres: with ``log_statement = all``, ``--requests`` one after another, streamed and not, each statement
  named with how often it ran per request. Every process counts: the gateway's admission and settling, the
  jobs' usage writer, the batch runner's poll (which runs idle too, so it counts per second, not per request).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, lscpu  # noqa: E402
from bench.proc import cpu_seconds, io_calls  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from bench.streams import model_of, start_system  # noqa: E402

RATE = 200.0  # tokens/s of each simulated sequence: a 4-token request takes 20 ms
MODEL = model_of(RATE)


async def log_every_statement(database_url: str, on: bool) -> None:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("ALTER SYSTEM SET log_statement = 'all'" if on else "ALTER SYSTEM RESET log_statement")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


def chat_body(max_tokens: int, stream: bool = True) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "stream": stream}
    return body | {"stream_options": {"include_usage": True}} if stream else body


# What each API is sent: its path and a streamed body of ``max_tokens`` tokens.
APIS = {
    "chat": ("/v1/chat/completions", chat_body),
    "responses": ("/v1/responses", lambda max_tokens: {
        "model": MODEL, "input": "hi", "max_output_tokens": max_tokens, "stream": True}),
}


async def send(base_url: str, key: str, n: int, stream: bool) -> None:
    """``n`` chat completions of 4 tokens, one after another."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(n):
            r = await http.post(f"{base_url}/v1/chat/completions", json=chat_body(4, stream),
                                headers={"Authorization": f"Bearer {key}"})
            r.raise_for_status()
            if stream:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]


async def send_many(base_url: str, key: str, n: int, concurrency: int, api: str, max_tokens: int) -> None:
    """``n`` streamed requests to ``api``, ``concurrency`` at a time, each read to its end."""
    import httpx

    path, body_of = APIS[api]
    body = body_of(max_tokens)
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as http:
        async def one() -> None:
            async with http.stream("POST", f"{base_url}{path}", json=body,
                                   headers={"Authorization": f"Bearer {key}"}) as r:
                r.raise_for_status()
                async for _ in r.aiter_raw():
                    pass

        for start in range(0, n, concurrency):
            await asyncio.gather(*(one() for _ in range(min(concurrency, n - start))))


def gateway_cost(system, key: str, n: int, concurrency: int, api: str,
                 max_tokens: int) -> tuple[float, float, float]:
    """The gateway's (write calls, read calls, CPU ms) per request over ``n`` requests of ``max_tokens``."""
    pid = system.pids()["gateway"]
    (writes, reads), cpu_s = io_calls(pid), cpu_seconds(pid)
    asyncio.run(send_many(system.url(), key, n, concurrency, api, max_tokens))
    (writes_after, reads_after), cpu_s_after = io_calls(pid), cpu_seconds(pid)
    return (writes_after - writes) / n, (reads_after - reads) / n, (cpu_s_after - cpu_s) * 1000 / n


def billed(config) -> None:
    """Until the usage writer has written every request's row (so its inserts are counted, and no later count)."""
    from tests.support.system import wait_usage_written

    asyncio.run(wait_usage_written(config.nats_url, timeout_s=120))


def named_statements(work: Path, config, system, key: str, n: int, stream: bool) -> list[tuple[str, float]]:
    """Each statement logged while ``n`` requests ran one after another (every process's, the idle ones'
    too), with its count per request."""
    logs = sorted(work.rglob("*.log")) + sorted(work.rglob("postgresql-*"))
    marks = {p: p.stat().st_size for p in logs}
    asyncio.run(log_every_statement(config.database_url, True))
    time.sleep(0.5)  # the reload reaches every backend at its next command; a few of the idle ones go uncounted
    asyncio.run(send(system.url(), key, n, stream))
    billed(config)
    asyncio.run(log_every_statement(config.database_url, False))
    text = "".join(p.read_text(errors="replace")[marks.get(p, 0):] for p in logs if p.exists())
    found = re.findall(r"LOG:\s+(?:statement|execute [^:]*):\s*(.*?)(?=\n\S|\Z)", text, flags=re.S)
    counted = collections.Counter(" ".join(s.split())[:110] for s in found)
    ours = {"SELECT pg_reload_conf()", "ALTER SYSTEM RESET log_statement"}
    return [(s, count / n) for s, count in counted.most_common() if s not in ours]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=50, help="for the Postgres statements, each way")
    p.add_argument("--gateway-requests", type=int, default=600, help="for the gateway's cost, each length")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--results", default=str(RESULTS), help="'-' to skip")
    args = p.parse_args()
    cpu = cpu_name(lscpu())
    work = Path(tempfile.mkdtemp(prefix="switchyard-db-"))
    work.chmod(0o755)  # Postgres runs as nobody under root and must enter it
    system = None
    try:
        system, keys = start_system(work, gateways=1, rates={RATE: 16})
        config, key = system.config, keys[0]
        asyncio.run(send(system.url(), key, 10, True))  # warm: the key's cache, the tenant's consumer
        billed(config)
        gateway = [(api, f"{t}", *(f"{v:.2f}" for v in gateway_cost(system, key, args.gateway_requests,
                                                                   args.concurrency, api, t)))
                   for api in APIS for t in (1, 4)]
        billed(config)
        named = {stream: dict(named_statements(work, config, system, key, args.requests, stream))
                 for stream in (True, False)}
    finally:
        if system is not None:
            system.stop()
        shutil.rmtree(work, ignore_errors=True)
    costs = markdown_table(["API", "tokens per request", "gateway socket writes per request", "reads", "gateway CPU ms "
                            "per request"], gateway)
    statements = markdown_table(["statement (every process's)", "per streamed request", "per request not streamed"],
                                [(f"`{s}`", f"{named[True].get(s, 0):.2f}", f"{named[False].get(s, 0):.2f}")
                                 for s in dict.fromkeys([*named[True], *named[False]])])
    text = (f"## What a request costs apart from its tokens ({time.strftime('%Y-%m-%d')}, {cpu})\n\n"
            f"`{command_line()}`\n\nThe gateway, {args.gateway_requests} streamed requests of each length, "
            f"{args.concurrency} at a time:\n\n{costs}\n\nPostgres: every statement logged over {args.requests} "
            f"requests of 4 tokens each way, one at a time:\n\n{statements}\n")
    print(text)
    append_section(text, args.results)


if __name__ == "__main__":
    main()
