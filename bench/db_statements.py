"""What one request costs Postgres: the statements every process of the platform sends for it, counted and named,
the model taken out. The figure sizes Postgres for a deployment (README, Scaling): requests/s times this.

    .venv/bin/python bench/db_statements.py                    # 200 streamed, then 200 unstreamed requests
    .venv/bin/python bench/db_statements.py --requests 500 --results -

A system on embedded servers with the simulated engine (workers/simulated_engine.py, a test double) serves one key
``--requests`` chat completions of 4 tokens, one after another. Postgres counts the transactions it commits
(``pg_stat_database.xact_commit``: one per statement outside a transaction); what the platform commits while idle
(the batch runner's poll, the registry's heartbeat rows) is measured over as long and taken off. Then, with
``log_statement = all`` for a few requests, each statement is named with how often it ran per request. Every
process counts: the gateway's admission and settling, the jobs' usage writer, the batch runner.
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
from bench.local import cpu_name, lscpu, unlimited_keys  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402

ADMIN_KEY = "bench-db-admin"
MODEL = "sim"
NAMED = 5  # requests run with every statement logged
SETTLE_S = 2.0  # for the usage writer to bill the last request before a count is read


def start_system(work: Path):
    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
    from tests.support.system import free_port

    config = SwitchyardConfig(data_dir=work, gateway=GatewayConfig(port=free_port(), admin_key=ADMIN_KEY),
                              worker=WorkerConfig(engine="simulated", heartbeat_s=1.0))
    system = LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True)
    system.start_servers()
    system.start_worker("worker-sim", model=MODEL, max_num_seqs=16, simulated_tokens_per_s=200.0)
    system.start_gateway()
    system.wait_until_ready(MODEL, timeout_s=120)
    return system, config


async def commits(database_url: str) -> int:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetchval("SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()")
    finally:
        await conn.close()


async def log_every_statement(database_url: str, on: bool) -> None:
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("ALTER SYSTEM SET log_statement = 'all'" if on else "ALTER SYSTEM RESET log_statement")
        await conn.execute("SELECT pg_reload_conf()")
    finally:
        await conn.close()


async def send(base_url: str, key: str, n: int, stream: bool) -> None:
    import httpx

    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    async with httpx.AsyncClient(timeout=30) as http:
        for _ in range(n):
            r = await http.post(f"{base_url}/v1/chat/completions", json=body,
                                headers={"Authorization": f"Bearer {key}"})
            r.raise_for_status()
            if stream:
                assert r.text.rstrip().endswith("data: [DONE]"), r.text[-200:]


def per_request(system, config, key: str, n: int, stream: bool, idle_per_s: float) -> float:
    """Commits per request over ``n`` requests, less what the platform commits idle over as long."""
    before, began = asyncio.run(commits(config.database_url)), time.monotonic()
    asyncio.run(send(system.url(), key, n, stream))
    time.sleep(SETTLE_S)
    after, took = asyncio.run(commits(config.database_url)), time.monotonic() - began
    return (after - before - 1 - idle_per_s * took) / n  # 1: the count's own read


def named_statements(work: Path, config, system, key: str) -> list[tuple[str, float]]:
    """Each statement logged while ``NAMED`` requests ran (every process's), with its count per request."""
    logs = sorted(work.rglob("*.log")) + sorted(work.rglob("postgresql-*"))
    marks = {p: p.stat().st_size for p in logs}
    asyncio.run(log_every_statement(config.database_url, True))
    time.sleep(0.5)  # the reload reaches every backend at its next command; a few of the idle ones go uncounted
    asyncio.run(send(system.url(), key, NAMED, True))
    time.sleep(SETTLE_S)
    asyncio.run(log_every_statement(config.database_url, False))
    text = "".join(p.read_text(errors="replace")[marks.get(p, 0):] for p in logs if p.exists())
    found = re.findall(r"LOG:\s+(?:statement|execute [^:]*):\s*(.*?)(?=\n\S|\Z)", text, flags=re.S)
    counted = collections.Counter(" ".join(s.split())[:110] for s in found)
    ours = {"SELECT pg_reload_conf()", "ALTER SYSTEM RESET log_statement"}
    return [(s, n / NAMED) for s, n in counted.most_common() if s not in ours]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--results", default=str(RESULTS), help="'-' to skip")
    args = p.parse_args()
    cpu = cpu_name(lscpu())
    work = Path(tempfile.mkdtemp(prefix="switchyard-db-"))
    work.chmod(0o755)  # Postgres runs as nobody under root and must enter it
    system = None
    try:
        system, config = start_system(work)
        key = asyncio.run(unlimited_keys(config.database_url, "pro", "db"))[0]
        asyncio.run(send(system.url(), key, 10, True))  # warm: the key's cache, the tenant's consumer
        time.sleep(SETTLE_S)
        idle_s = 10.0
        before = asyncio.run(commits(config.database_url))
        time.sleep(idle_s)
        idle_per_s = (asyncio.run(commits(config.database_url)) - before - 1) / idle_s
        rows = [(label, f"{per_request(system, config, key, args.requests, stream, idle_per_s):.2f}")
                for label, stream in (("streamed", True), ("not streamed", False))]
        named = named_statements(work, config, system, key)
    finally:
        if system is not None:
            system.stop()
        shutil.rmtree(work, ignore_errors=True)
    table = markdown_table(["request", "Postgres commits per request"], rows)
    statements = markdown_table(["statement (every process's)", "per request"],
                                [(f"`{s}`", f"{n:.1f}") for s, n in named])
    text = (f"## Postgres statements per request ({time.strftime('%Y-%m-%d')}, {cpu})\n\n`{command_line()}`: "
            f"{args.requests} requests of 4 tokens each way, idle commits ({idle_per_s:.1f}/s) taken off.\n\n"
            f"{table}\n\nStatements logged over {NAMED} streamed requests:\n\n{statements}\n")
    print(text)
    append_section(text, args.results)


if __name__ == "__main__":
    main()
