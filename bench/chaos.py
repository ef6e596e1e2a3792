"""Faults under steady streaming load: what each one costs the clients, and whether anything is lost or misbilled.

    .venv/bin/python bench/chaos.py                         # every case, ~6 min on 2 CPU cores
    .venv/bin/python bench/chaos.py --case worker-kill --case pg-hang
    .venv/bin/python bench/chaos.py --model smollm2 --max-tokens 32   # the real model (from the model cache)

Each case starts a fresh system (its own NATS, or a three-node JetStream cluster with streams at R3; its own
Postgres; one gateway; one or two workers of the tiny random test model by default, so the numbers are about the
plumbing, not the model), runs ``--clients`` closed-loop clients streaming chat completions (``stream_options.
include_usage``, temperature 0, ``ignore_eos``) for ``--duration`` s, and injects its fault at ``--fault-at`` s:

    worker-failover   SIGKILL one of two workers (its streams should go on on the other)
    worker-kill       SIGKILL the only worker (streams end with worker_lost); a new one is started 3 s later
    worker-stall      SIGSTOP one of two workers for 6 s, then SIGCONT (taken for dead, continued on the other)
    nats-restart      stop the NATS server, start a new one on the same port and store 3 s later
    nats-node-kill    three-node JetStream cluster: SIGKILL the node leading the request stream
    pg-hang           SIGSTOP every Postgres process for 10 s, then SIGCONT
    pg-down           stop Postgres, start it again on the same data and port 10 s later

Per case, over every request the clients sent:

    completed     the stream ended with a finish_reason and [DONE]
    failed        an explicit error: HTTP status and error code, or the in-stream error event's code; "client X
                  before headers" = no answer at all (connection refused, timeout waiting for headers)
    lost          accepted (HTTP 200, an X-Request-Id, or a first chunk) but ended with neither a finish nor an
                  error: a cut connection, a hang past the client's read timeout, [DONE] with no finish_reason
    unbilled      completed, but no row in Postgres ``requests`` 60 s after the load
    misbilled     a completed request's row whose completion_tokens differ from the usage the client was sent
    billed twice  request ids with more than one ``requests`` row (its primary key makes this 0 by construction),
                  plus (as "usage dup") ids with more than one record on the USAGE stream (the key keeps the first)
    stall         the longest gap between two consecutive SSE chunks of one stream; first = the longest wait for a
                  first chunk (TTFT, including queueing)
    after         requests sent after the fault's last step (restart, SIGCONT): completed / sent

The fault's steps are logged with their times (seconds into the load). When a case shows anything lost, unbilled,
misbilled or billed twice, or a stall over ``--long-stall`` s, the WARNING/ERROR lines of its logs are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import httpx  # noqa: E402
import psutil  # noqa: E402

from bench.chaos_report import (  # noqa: E402
    COLUMNS,
    billing,
    case_logs,
    cpu_lines,
    log_excerpt,
    notes,
    print_table,
    row,
    summarize,
    usage_duplicates,
)
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

CASES = ["worker-failover", "worker-kill", "worker-stall", "nats-restart", "nats-node-kill", "pg-hang", "pg-down"]
TWO_WORKERS = ("worker-failover", "worker-stall")


@dataclass
class Stream:
    sent_at: float  # s into the load
    status: int | None = None
    request_id: str | None = None
    accepted: bool = False
    finish: str | None = None
    error: str | None = None  # an explicit error: the request failed
    lost_why: str | None = None  # accepted, then neither a finish nor an error
    done: bool = False
    completion_tokens: int | None = None
    first_chunk_s: float | None = None
    longest_gap_s: float = 0.0

    @property
    def outcome(self) -> str:
        if self.error is not None:
            return "failed"
        if self.done and self.finish is not None:
            return "completed"
        return "lost" if self.accepted else "failed"


@dataclass
class Servers:
    """What a case runs on, and how to reach and hurt it; ``marks``: the fault's steps, (s into the load, what)."""

    work: Path
    pg_dir: Path
    nats: NatsServer | None = None
    cluster: NatsCluster | None = None
    pg: PostgresServer | None = None
    pg_port: int = 0
    nats_port: int = 0
    system: LocalSystem | None = None
    workers: list = field(default_factory=list)
    load_start: float = 0.0
    marks: list = field(default_factory=list)

    @property
    def nats_url(self) -> str:
        return self.cluster.url if self.cluster is not None else self.nats.url

    def mark(self, what: str) -> None:
        self.marks.append((time.monotonic() - self.load_start, what))
        print(f"  {self.marks[-1][0]:6.1f} s  {what}", flush=True)

    def stop(self) -> None:
        """Everything by PID, each step on its own: a failure to stop one leaves no other running."""
        steps = []
        if self.system is not None:
            steps += [lambda w=w: signal_tree(w.pid, signal.SIGCONT) for w in self.workers if w.is_running()]
            steps.append(self.system.stop)
        if self.pg is not None and self.pg._proc is not None:
            steps.append(lambda: signal_tree(self.pg.pid, signal.SIGCONT))  # a hung one would not stop
        steps += [server.stop for server in (self.pg, self.nats, self.cluster) if server is not None]
        for step in steps:
            try:
                step()
            except Exception as exc:
                print(f"could not stop: {exc!r}", file=sys.stderr)


def _process_tree(pid: int) -> list[int]:
    try:
        parent = psutil.Process(pid)
        return [pid] + [p.pid for p in parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def signal_tree(pid: int, sig: int) -> list[int]:
    """Send ``sig`` to ``pid`` and every process below it; returns their pids (the soak's faults use it too)."""
    pids = _process_tree(pid)
    for p in pids:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass
    return pids


# -- the load -----------------------------------------------------------------------------------------------
async def stream_one(http: httpx.AsyncClient, model: str, max_tokens: int, i: int, load_start: float) -> Stream:
    sent = last = time.monotonic()
    s = Stream(sent_at=sent - load_start)
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me story number {i}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    try:
        async with http.stream("POST", "/v1/chat/completions", json=body) as r:
            s.status, s.request_id = r.status_code, r.headers.get("X-Request-Id")
            if r.status_code != 200:
                await r.aread()
                try:
                    s.error = f"{r.status_code} {r.json()['error']['code']}"
                except Exception:
                    s.error = f"{r.status_code} (no OpenAI error body)"
                return s
            s.accepted = True
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
                    continue  # [DONE] may follow
                for choice in event.get("choices") or []:
                    s.finish = choice.get("finish_reason") or s.finish
                if event.get("usage"):
                    s.completion_tokens = event["usage"]["completion_tokens"]
            if not s.done and s.error is None:
                s.lost_why = "stream closed without [DONE]"
            elif s.done and s.finish is None and s.error is None:
                s.lost_why = "[DONE] without a finish_reason or error"
    except Exception as exc:  # noqa: BLE001 - a cut connection, a read timeout, a garbled line: all end the stream
        if s.accepted or s.request_id:  # accepted, then cut or hung: nobody told the client why
            s.accepted, s.lost_why = True, f"{type(exc).__name__} after accept"
        elif s.error is None:
            s.error = f"client {type(exc).__name__} before headers"
    return s


def run_load(servers: Servers, model: str, headers: dict, args, fault) -> list[Stream]:
    """Closed-loop clients for ``args.duration`` s on a thread of their own; ``fault()`` runs on this one at
    ``args.fault_at`` s. Servers are (re)started on this thread: each dies with the thread that started it."""
    streams: list[Stream] = []
    counter = iter(range(10**9))
    servers.load_start = time.monotonic()
    stop_at = servers.load_start + args.duration

    async def clients():
        async def client(http):
            while time.monotonic() < stop_at:
                streams.append(await stream_one(http, model, args.max_tokens, next(counter), servers.load_start))

        timeout = httpx.Timeout(args.client_timeout, connect=10)
        async with httpx.AsyncClient(base_url=servers.system.url(), headers=headers, timeout=timeout) as http:
            await asyncio.gather(*(client(http) for _ in range(args.clients)))

    load = threading.Thread(target=asyncio.run, args=(clients(),))
    load.start()
    try:
        time.sleep(args.fault_at)
        fault()
    finally:
        load.join()
    servers.mark(f"load over ({len(streams)} requests)")
    return streams


# -- the cases --------------------------------------------------------------------------------------------------
def start(servers: Servers, args, case: str, model_dir: Path, model: str) -> str:
    """Start the case's servers and system; returns an API key."""
    servers.pg_port = free_port()
    servers.pg = PostgresServer(servers.pg_dir, port=servers.pg_port, ephemeral=True).start()
    if case == "nats-node-kill":
        servers.cluster = NatsCluster(servers.work / "nats", size=3).start()
    else:
        servers.nats_port = free_port()
        servers.nats = NatsServer(servers.work / "nats", port=servers.nats_port).start()
    asyncio.run(apply_migrations(servers.pg.url))
    key = asyncio.run(make_key(servers.pg.url, "chaos", "pro", rpm_limit=1_000_000, tpm_limit=10**9))
    num_workers = 2 if case in TWO_WORKERS else 1
    # Workers on one host share its cores: two with torch's default (every core each) were seen ~5x slower
    # than one on 2 cores, so by default each gets its share.
    threads = args.torch_threads or max(1, (os.cpu_count() or 1) // num_workers)
    worker = WorkerConfig(model=str(model_dir), served_model_name=model, max_num_seqs=8, drain_timeout_s=10,
                          torch_threads=threads, **({"dtype": "float32"} if args.model == "tiny" else {}))
    config = SwitchyardConfig(
        data_dir=servers.work, nats_url=servers.nats_url, nats_replicas=3 if servers.cluster else 1,
        database_url=servers.pg.url, gateway=GatewayConfig(port=free_port(), queue_timeout_s=30, drain_timeout_s=10),
        worker=worker)
    servers.system = LocalSystem(config, log_dir=servers.work, log_level="INFO")
    servers.workers = [servers.system.start_worker(f"worker-{i}") for i in range(num_workers)]
    servers.system.start_gateway()
    servers.system.wait_until_ready(model, timeout_s=300)
    asyncio.run(_wait_for_workers(servers.nats_url, model, [w.pid for w in servers.workers]))
    return key


async def _wait_for_workers(url: str, model: str, pids: list[int], timeout_s: float = 120) -> None:
    """Until a heartbeat of each worker process in ``pids`` is in the registry (a killed one's stays a while)."""
    nc = await nats_client.connect(url, "chaos-probe", reconnect_forever=False)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if set(pids) <= {w.pid for w in await live_workers(nc.jetstream()) if w.model == model}:
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"workers {pids} of {model} did not register in {timeout_s:.0f} s")
    finally:
        await nc.close()


def fault_for(case: str, servers: Servers, model: str):
    mark = servers.mark

    def worker_failover():
        pids = signal_tree(servers.workers[0].pid, signal.SIGKILL)
        mark(f"SIGKILL worker-0 (pids {pids}); worker-1 alive")

    def worker_kill():
        pids = signal_tree(servers.workers[0].pid, signal.SIGKILL)
        mark(f"SIGKILL worker-0 (pids {pids}), the only worker")
        time.sleep(3)
        servers.workers.append(servers.system.start_worker("worker-again"))
        mark("worker-again started")
        asyncio.run(_wait_for_workers(servers.nats_url, model, [servers.workers[-1].pid]))
        mark("worker-again registered")

    def worker_stall():
        pids = signal_tree(servers.workers[0].pid, signal.SIGSTOP)
        mark(f"SIGSTOP worker-0 (pids {pids}); worker-1 alive")
        time.sleep(6)
        signal_tree(servers.workers[0].pid, signal.SIGCONT)
        mark("SIGCONT worker-0")

    def nats_restart():
        servers.nats.stop()
        mark(f"NATS stopped (SIGTERM, port {servers.nats_port})")
        time.sleep(3)
        servers.nats = NatsServer(servers.work / "nats", port=servers.nats_port).start()
        mark("NATS started again, same port and store")

    def nats_node_kill():
        async def leader() -> str:
            nc = await nats_client.connect(servers.cluster.url, "chaos-probe", reconnect_forever=False)
            try:
                return (await nc.jetstream().stream_info(subjects.request_stream("pro"))).cluster.leader
            finally:
                await nc.close()
        name = asyncio.run(leader())
        servers.cluster.kill(name)
        mark(f"SIGKILL NATS node {name}, leader of {subjects.request_stream('pro')}")

    def pg_hang():
        pids = signal_tree(servers.pg.pid, signal.SIGSTOP)
        mark(f"SIGSTOP {len(pids)} postgres processes")
        time.sleep(10)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        mark("SIGCONT postgres")

    def pg_down():
        servers.pg.stop()
        mark("postgres stopped (SIGINT, fast shutdown)")
        time.sleep(10)
        servers.pg = PostgresServer(servers.pg_dir, port=servers.pg_port, ephemeral=True).start()
        mark("postgres started again, same data and port")

    return {"worker-failover": worker_failover, "worker-kill": worker_kill, "worker-stall": worker_stall,
            "nats-restart": nats_restart, "nats-node-kill": nats_node_kill, "pg-hang": pg_hang,
            "pg-down": pg_down}[case]


# -- one case ---------------------------------------------------------------------------------------------------
def run_case(args, case: str) -> dict:
    model = "smollm2" if args.model == "smollm2" else "tiny-chaos"
    work = Path(tempfile.mkdtemp(prefix=f"switchyard-chaos-{case}-"))
    pg_dir = Path(tempfile.mkdtemp(prefix="switchyard-chaos-pg-"))
    pg_dir.chmod(0o755)  # postgres runs as nobody under root
    servers = Servers(work, pg_dir)
    try:
        if args.model == "smollm2":
            model_dir = SwitchyardConfig().model_cache_dir / "smollm2"
            if not (model_dir / "config.json").exists():
                sys.exit(f"no model at {model_dir}: run `switchyard models pull smollm2`")
        else:
            model_dir = save_tiny_model(work / "model", max_context=1024)
        key = start(servers, args, case, model_dir, model)
        streams = run_load(servers, model, {"Authorization": f"Bearer {key}"}, args, fault_for(case, servers, model))
        bill = asyncio.run(billing(servers.pg.url, streams))
        records, dups = asyncio.run(usage_duplicates(servers.nats_url))
        result = summarize(case, streams, servers.marks, bill, records, dups)
        if (result["lost"] or result["failed"] or bill["unbilled"] or bill["misbilled"] or bill["twice"] or dups
                or result["stall"] > args.long_stall):
            result["logs"] = log_excerpt(work, pg_dir)
        if args.dump:  # every stream, and the fault's steps, for a closer look
            Path(args.dump).mkdir(parents=True, exist_ok=True)
            with open(Path(args.dump) / f"{case}.jsonl", "w") as f:
                f.write(json.dumps({"marks": servers.marks}) + "\n")
                f.writelines(json.dumps(asdict(s)) + "\n" for s in streams)
        if args.logs:
            dest = Path(args.logs) / case
            dest.mkdir(parents=True, exist_ok=True)
            for path in case_logs(work, pg_dir):
                if path.exists():
                    shutil.copy(path, dest / str(path.relative_to(path.parents[1])).replace("/", "_"))
        return result
    finally:
        servers.stop()
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(pg_dir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--case", action="append", choices=CASES, help="run only these (repeatable; default all)")
    parser.add_argument("--model", choices=["tiny", "smollm2"], default="tiny")
    parser.add_argument("--clients", type=int, default=6)
    parser.add_argument("--duration", type=float, default=25.0, help="seconds of load per case")
    parser.add_argument("--fault-at", type=float, default=8.0, help="seconds into the load")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--client-timeout", type=float, default=90.0, help="read timeout: a stream silent this long "
                                                                          "is lost")
    parser.add_argument("--torch-threads", type=int, default=0, help="per worker (default: the cores / workers)")
    parser.add_argument("--long-stall", type=float, default=5.0, help="print the logs of a case stalled this long")
    parser.add_argument("--logs", help="copy every case's logs under this directory")
    parser.add_argument("--dump", help="write every stream of every case to <dir>/<case>.jsonl")
    parser.add_argument("--results", default=None, help="markdown file to append to; '-' for none")
    args = parser.parse_args()
    logging.getLogger("nats.aio.client").setLevel(logging.CRITICAL)  # this script's probes meet a killed node
    cpu = cpu_lines()
    print("\n".join(cpu), flush=True)
    command, results = command_line(), []
    for case in args.case or CASES:
        print(f"--- {case}", flush=True)
        try:
            results.append(run_case(args, case))
        except Exception as exc:  # a case that could not run says so, and the others still run
            print(f"case {case} could not run: {exc!r}", flush=True)
            continue
        print_table(case, [row(results[-1])])
        print("\n".join(notes(results[-1])), flush=True)
        if results[-1].get("logs"):
            print(results[-1]["logs"], flush=True)
    print_table("chaos: faults under streaming load", [row(r) for r in results])
    load = (f"{args.clients} clients streaming {args.max_tokens}-token chat completions (closed loop, temperature 0, "
            f"ignore_eos, include_usage) for {args.duration:.0f} s per case, the fault at {args.fault_at:.0f} s; "
            f"model {args.model}, max_num_seqs 8, torch threads per worker "
            f"{args.torch_threads or 'cores / workers'}; client read timeout {args.client_timeout:.0f} s")
    text = "\n".join([f"## Chaos: faults under streaming load ({time.strftime('%Y-%m-%d')})", "", f"`{command}`", "",
                      "Machine: " + "; ".join(cpu) + f". {load}.", "",
                      markdown_table(COLUMNS, [row(r) for r in results]), "",
                      *(line for r in results for line in notes(r))])
    print("\n" + text, flush=True)
    if args.results != "-":
        append_section(text, *([args.results] if args.results else []))


if __name__ == "__main__":
    main()
