"""Faults under steady streaming load: what each one costs the clients, and whether anything is lost or misbilled.

    .venv/bin/python bench/chaos.py                         # every case, ~6 min on 2 CPU cores
    .venv/bin/python bench/chaos.py --case worker-kill --case pg-hang

Each case starts a fresh system on embedded servers (its own NATS, or a three-node cluster; its own Postgres;
the tiny random test model, so the numbers are about the plumbing, not the model), runs ``--clients`` closed-loop
clients streaming chat completions for ``--duration`` seconds, and injects its fault at ``--fault-at`` seconds:

    worker-failover   SIGKILL one of two workers (its streams should go on on the other)
    worker-kill       SIGKILL the only worker; a new one is started 3 s later
    worker-stall      SIGSTOP one of two workers for 6 s, then SIGCONT
    nats-restart      stop the NATS server, start it again on the same port and store 3 s later
    nats-node-kill    three-node JetStream cluster, streams at R3: SIGKILL the request stream's leader
    pg-hang           SIGSTOP every Postgres process for 10 s, then SIGCONT
    pg-down           stop Postgres, start it again on the same data 10 s later

Per case: sent; completed (a finish_reason and [DONE]); failed, by reason (HTTP status and code, or the error event's
code); lost = accepted (HTTP 200) but ended with neither a finish nor an error (must be 0); unbilled = completed with
no usage row 60 s after the load; misbilled = a row whose completion_tokens differ from what the client was told;
billed twice = request ids with more than one row (the table's key makes it 0 by construction; counted all the
same); longest stall = the longest gap between two chunks of one stream, and the longest wait for a first chunk.
Printed, and appended to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import asyncpg  # noqa: E402
import httpx  # noqa: E402

from bench.engine import machine  # noqa: E402
from bench.results import append_section, command_line, markdown_table  # noqa: E402
from switchyard.deploy.launcher import NatsServer, PostgresServer  # noqa: E402
from switchyard.deploy.nats_cluster import NatsCluster  # noqa: E402
from switchyard.deploy.processes import free_port  # noqa: E402
from switchyard.deploy.system import LocalSystem  # noqa: E402
from switchyard.migrations import apply_migrations  # noqa: E402
from switchyard.shared import nats_client, subjects  # noqa: E402
from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig  # noqa: E402
from switchyard.shared.jetstream import live_workers  # noqa: E402
from tests.support.system import make_key  # noqa: E402
from tests.support.tiny_model import save_tiny_model  # noqa: E402

MODEL = "tiny-chaos"
CASES = ["worker-failover", "worker-kill", "worker-stall", "nats-restart", "nats-node-kill", "pg-hang", "pg-down"]


@dataclass
class Stream:
    status: int | None = None
    request_id: str | None = None
    finish: str | None = None
    error: str | None = None
    done: bool = False
    completion_tokens: int | None = None
    first_chunk_s: float | None = None
    longest_gap_s: float = 0.0


@dataclass
class Servers:
    """What a case runs on, and how to reach and hurt it."""

    work: Path
    nats: NatsServer | None = None
    cluster: NatsCluster | None = None
    pg: PostgresServer | None = None
    pg_dir: Path | None = None
    pg_port: int = 0
    nats_port: int = 0
    system: LocalSystem | None = None
    workers: list = field(default_factory=list)

    @property
    def nats_url(self) -> str:
        return self.cluster.url if self.cluster is not None else self.nats.url

    def stop(self) -> None:
        if self.system is not None:
            for worker in self.workers:  # a stopped one would make the SIGTERM wait
                _signal_tree(worker.pid, signal.SIGCONT)
            self.system.stop()
        if self.pg is not None:
            _signal_tree(self.pg.pid, signal.SIGCONT) if self.pg._proc is not None else None
            self.pg.stop()
        for server in (self.nats, self.cluster):
            if server is not None:
                server.stop()
        if self.pg_dir is not None:
            shutil.rmtree(self.pg_dir, ignore_errors=True)


def _process_tree(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for child in children for p in _process_tree(int(child))]


def _signal_tree(pid: int, sig: int) -> None:
    for p in _process_tree(pid):
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


# -- the load -----------------------------------------------------------------------------------------------
async def stream_one(http: httpx.AsyncClient, headers: dict, max_tokens: int, i: int) -> Stream:
    s = Stream()
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"story {i}"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = last = time.monotonic()
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            s.status, s.request_id = r.status_code, r.headers.get("X-Request-Id")
            if r.status_code != 200:
                await r.aread()
                try:
                    s.error = f"{r.status_code} {r.json()['error']['code']}"
                except Exception:
                    s.error = f"{r.status_code} unreadable"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.monotonic()
                if s.first_chunk_s is None:
                    s.first_chunk_s = now - sent
                else:
                    s.longest_gap_s = max(s.longest_gap_s, now - last)
                last = now
                if line == "data: [DONE]":
                    s.done = True
                    break
                event = json.loads(line[6:])
                if "error" in event:
                    s.error = f"event {event['error'].get('code')}"
                    break
                for choice in event.get("choices") or []:
                    s.finish = choice.get("finish_reason") or s.finish
                if event.get("usage"):
                    s.completion_tokens = event["usage"]["completion_tokens"]
    except (httpx.HTTPError, ValueError) as exc:  # a cut connection or a hang past the client timeout
        s.error = s.error or f"client {type(exc).__name__}"
    return s


def run_load(base_url: str, headers: dict, args, fault) -> list[Stream]:
    """Closed-loop clients for ``args.duration`` s on a thread of their own; ``fault()`` runs on this one at
    ``args.fault_at`` s. Servers are (re)started on this thread: each dies with the thread that started it."""
    streams: list[Stream] = []
    stop_at = time.monotonic() + args.duration
    counter = iter(range(10**9))

    async def clients():
        async def client(http):
            while time.monotonic() < stop_at:
                streams.append(await stream_one(http, headers, args.max_tokens, next(counter)))

        async with httpx.AsyncClient(base_url=base_url, timeout=args.client_timeout) as http:
            await asyncio.gather(*(client(http) for _ in range(args.clients)))

    load = threading.Thread(target=asyncio.run, args=(clients(),))
    load.start()
    time.sleep(args.fault_at)
    fault()
    load.join()
    return streams


# -- the cases --------------------------------------------------------------------------------------------------
def start(args, case: str) -> tuple[Servers, SwitchyardConfig, str]:
    work = Path(tempfile.mkdtemp(prefix=f"switchyard-chaos-{case}-"))
    servers = Servers(work)
    servers.pg_dir = Path(tempfile.mkdtemp(prefix="switchyard-chaos-pg-"))
    servers.pg_dir.chmod(0o755)  # postgres runs as nobody under root
    servers.pg_port = free_port()
    servers.pg = PostgresServer(servers.pg_dir, port=servers.pg_port, ephemeral=True).start()
    if case == "nats-node-kill":
        servers.cluster = NatsCluster(work / "nats", size=3).start()
    else:
        servers.nats_port = free_port()
        servers.nats = NatsServer(work / "nats", port=servers.nats_port).start()
    asyncio.run(apply_migrations(servers.pg.url))
    key = asyncio.run(make_key(servers.pg.url, "chaos", "pro", rpm_limit=1_000_000, tpm_limit=10**9))
    config = SwitchyardConfig(
        data_dir=work, nats_url=servers.nats_url, nats_replicas=3 if servers.cluster else 1,
        database_url=servers.pg.url, gateway=GatewayConfig(port=free_port(), queue_timeout_s=30),
        worker=WorkerConfig(model=str(save_tiny_model(work / "model", max_context=1024)), served_model_name=MODEL,
                            dtype="float32", max_num_seqs=8))
    servers.system = LocalSystem(config, log_dir=work, log_level="INFO")
    num_workers = 2 if case in ("worker-failover", "worker-stall") else 1
    servers.workers = [servers.system.start_worker(f"worker-{i}") for i in range(num_workers)]
    servers.system.start_gateway()
    servers.system.wait_until_ready(MODEL, timeout_s=120)
    asyncio.run(_wait_for_workers(servers.nats_url, num_workers))
    return servers, config, key


async def _wait_for_workers(url: str, count: int) -> None:
    nc = await nats_client.connect(url, "chaos-probe", reconnect_forever=False)
    try:
        for _ in range(600):
            if sum(w.model == MODEL for w in await live_workers(nc.jetstream())) >= count:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{count} workers did not register")
    finally:
        await nc.close()


def fault_for(case: str, servers: Servers):
    def worker_failover():
        os.kill(servers.workers[0].pid, signal.SIGKILL)

    def worker_kill():
        os.kill(servers.workers[0].pid, signal.SIGKILL)
        time.sleep(3)
        servers.workers.append(servers.system.start_worker("worker-again"))

    def worker_stall():
        os.kill(servers.workers[0].pid, signal.SIGSTOP)
        time.sleep(6)
        os.kill(servers.workers[0].pid, signal.SIGCONT)

    def nats_restart():
        servers.nats.stop()
        time.sleep(3)
        servers.nats = NatsServer(servers.work / "nats", port=servers.nats_port).start()

    def nats_node_kill():
        async def leader() -> str:
            nc = await nats_client.connect(servers.cluster.url, "chaos-probe", reconnect_forever=False)
            try:
                return (await nc.jetstream().stream_info(subjects.request_stream("pro"))).cluster.leader
            finally:
                await nc.close()
        servers.cluster.kill(asyncio.run(leader()))

    def pg_hang():
        pids = _process_tree(servers.pg.pid)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(10)
        for pid in pids:
            os.kill(pid, signal.SIGCONT)

    def pg_down():
        servers.pg.stop()
        time.sleep(10)
        servers.pg = PostgresServer(servers.pg_dir, port=servers.pg_port, ephemeral=True).start()

    return {"worker-failover": worker_failover, "worker-kill": worker_kill, "worker-stall": worker_stall,
            "nats-restart": nats_restart, "nats-node-kill": nats_node_kill, "pg-hang": pg_hang,
            "pg-down": pg_down}[case]


async def billing(url: str, streams: list[Stream], wait_s: float = 60.0) -> tuple[int, int, int]:
    """(unbilled, misbilled, billed twice) among the completed streams, after waiting up to ``wait_s``."""
    completed = {s.request_id: s.completion_tokens for s in streams if s.done and s.request_id}
    conn = await asyncpg.connect(url)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            rows = await conn.fetch("SELECT request_id, completion_tokens FROM requests WHERE request_id = ANY($1)",
                                    list(completed))
            if len(rows) >= len(completed) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        twice = await conn.fetchval("SELECT count(*) FROM (SELECT request_id FROM requests GROUP BY request_id "
                                    "HAVING count(*) > 1) d")
    finally:
        await conn.close()
    billed = {r["request_id"]: r["completion_tokens"] for r in rows}
    unbilled = sum(rid not in billed for rid in completed)
    misbilled = sum(rid in billed and billed[rid] != tokens for rid, tokens in completed.items())
    return unbilled, misbilled, twice


def run_case(args, case: str) -> dict:
    servers = None
    try:
        servers, config, key = start(args, case)
        streams = run_load(servers.system.url(), {"Authorization": f"Bearer {key}"}, args, fault_for(case, servers))
        unbilled, misbilled, twice = asyncio.run(billing(servers.pg.url, streams))
    finally:
        if servers is not None:
            servers.stop()
            shutil.rmtree(servers.work, ignore_errors=True)
    accepted = [s for s in streams if s.status == 200]
    failed = Counter(s.error for s in streams if s.error)
    return dict(
        case=case, sent=len(streams), completed=sum(s.done and s.finish is not None for s in streams),
        failed=failed, lost=sum(not s.done and s.error is None for s in accepted), unbilled=unbilled,
        misbilled=misbilled, twice=twice, stall=max((s.longest_gap_s for s in streams), default=0.0),
        first=max((s.first_chunk_s or 0.0 for s in streams), default=0.0))


COLUMNS = ["case", "sent", "completed", "failed (reason: count)", "lost", "unbilled", "misbilled", "billed twice",
           "longest stall s", "longest first chunk s"]


def row(r: dict) -> list:
    failed = ", ".join(f"{reason}: {n}" for reason, n in r["failed"].most_common()) or "0"
    return [r["case"], r["sent"], r["completed"], failed, r["lost"], r["unbilled"], r["misbilled"], r["twice"],
            f"{r['stall']:.1f}", f"{r['first']:.1f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=CASES, help="run only these (repeatable)")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of load per case")
    parser.add_argument("--fault-at", type=float, default=8.0, help="seconds into the load")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--client-timeout", type=float, default=90.0)
    parser.add_argument("--results", default=None, help="markdown file to append to; '-' for none")
    args = parser.parse_args()
    print(machine())
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith(("Model name", "CPU(s)", "Thread(s)")):
            print(line)
        elif line.startswith("Flags"):
            print("Flags (of interest):", " ".join(f for f in line.split() if f.startswith(("avx", "amx"))))
    results = []
    for case in args.case or CASES:
        print(f"--- {case}", flush=True)
        results.append(run_case(args, case))
        print(markdown_table(COLUMNS, [row(results[-1])]), flush=True)
    table = markdown_table(COLUMNS, [row(r) for r in results])
    print(table)
    text = (f"## Chaos: faults under streaming load ({time.strftime('%Y-%m-%d')})\n\n`{command_line()}`\n\n"
            f"Machine: {machine()}. Tiny random model, {args.clients} clients streaming {args.max_tokens}-token "
            f"chat completions for {args.duration:.0f} s per case, the fault at {args.fault_at:.0f} s.\n\n{table}\n")
    if args.results != "-":
        append_section(text, *([args.results] if args.results else []))


if __name__ == "__main__":
    main()
