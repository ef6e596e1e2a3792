"""The soak: the whole system for hours under mixed traffic, a fault every so often, every request accounted for.

    .venv/bin/python bench/soak.py                          # 2 hours, simulated engine, 2 workers, 2 gateways
    .venv/bin/python bench/soak.py --minutes 30 --window 5
    .venv/bin/python bench/soak.py --engine smollm2         # the real model, one worker

What runs: embedded NATS and Postgres, two gateways (a tenant sticks to one), the jobs process (billing, batches,
housekeeping), two workers of the simulated engine (a test double: the numbers are the plumbing's, not a
model's) or one SmolLM2 worker, and a worker of the embedding model (all-MiniLM-L6-v2) unless
``--no-embeddings``. The traffic is bench/soak_load.py's: tenants coming and going across the interactive tiers,
some over their limits, sending streamed and plain chat (some cut by their client), stored, background (some
cancelled) and resumed Responses, conversations over many turns, embeddings, and batches (files uploaded and
downloaded), open-loop at ``--rate`` requests per second.

Every ``--fault-every`` minutes the next fault of ``--faults`` (in turn):

    worker-kill    SIGKILL a worker; a new one is started at once (as a supervisor would)
    gateway-kill   SIGKILL the second gateway; started again on its port at once
    nats-restart   stop NATS, start it 5 s later on the same port and store
    pg-stop        stop Postgres for 20 s, then start it on the same data
    worker-stop    SIGSTOP a worker for 30 s, then SIGCONT

Recovery: from the fault's last step until a probe request answers on every gateway. After the load, ``--quiet``
seconds without traffic and a last sample: what the processes still hold per tenant once every tenant left.

Reported per ``--window`` minutes and at the end (bench/soak_report.py): every process's memory (PSS) and
open files, the JetStream streams, every table's rows and size, the data directory; the requests by outcome and
error code; TTFT per tier (outside the minute after each fault); the ledger (every completed request billed once,
with the tokens its client was told; no refused one billed); a PNG plot beside bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import httpx  # noqa: E402

from bench.chaos import signal_tree  # noqa: E402
from bench.chaos_report import cpu_lines, usage_duplicates  # noqa: E402
from bench.soak_load import Load, Outcome, Tenant  # noqa: E402
from bench.soak_sample import LedgerCheck, Sample, check_ledger, prompt_tokens_by_time, sample  # noqa: E402

FAULTS = ["worker-kill", "gateway-kill", "nats-restart", "pg-stop", "worker-stop"]
QUEUE_TIMEOUT_S = 60.0  # the gateways' cap on a request's wait (an enterprise request waits this long)
PROBE_TIMEOUT_S = QUEUE_TIMEOUT_S + 15.0
ADMIN_KEY = "soak-admin"
SIM_MODEL = "sim"
EMBED_MODEL = "minilm"


@dataclass
class FaultRun:
    name: str
    at: float  # s into the soak
    ended_at: float = 0.0  # the fault's last step
    recovered_s: float | None = None  # from its last step until every gateway answered a probe (None: never)


@dataclass
class SoakResult:
    cpu: list[str]
    seconds: float
    samples: list[Sample] = field(default_factory=list)
    faults: list[FaultRun] = field(default_factory=list)
    ledger: list[Outcome] = field(default_factory=list)
    check: LedgerCheck | None = None
    tenants_left: int = 0
    usage_duplicates: list = field(default_factory=list)  # (request id, each record's completion tokens)
    started_wall: float = 0.0
    prompts: list[tuple[float, int, int]] = field(default_factory=list)  # (accepted at, prompt tokens, cached)


class Soak:
    """The system, its load and its faults; ``run()`` returns what was measured and stops everything."""

    def __init__(self, args) -> None:
        self.args = args
        self.work = Path(tempfile.mkdtemp(prefix="switchyard-soak-"))
        os.chmod(self.work, 0o755)  # Postgres runs as nobody under root
        self.workers: list = []
        self.gateways: dict[str, int] = {}  # name -> port
        self.system = None
        self.model = SIM_MODEL if args.engine == "sim" else "smollm2"
        self.restarts = 0
        self.probes: list[Outcome] = []  # billed like any request: the ledger names them

    # -- the system ---------------------------------------------------------------------------------------------
    def start(self) -> None:
        from switchyard.deploy.system import LocalSystem
        from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
        from switchyard.workers.model_store import pull
        from tests.support.system import free_port, model_cache_dir

        ports = [free_port(), free_port()]
        if self.args.engine == "sim":
            worker = WorkerConfig(engine="simulated", heartbeat_s=1.0, max_num_seqs=64, simulated_tokens_per_s=40.0)
        else:  # pulled where the tests keep their models, as the embedding model is (a fresh clone has neither)
            worker = WorkerConfig(model=str(pull("smollm2", model_cache_dir())), served_model_name="smollm2",
                                  max_num_seqs=16, kv_offload_gib=self.args.kv_offload_gib)
        config = SwitchyardConfig(data_dir=self.work, worker=worker,
                                  gateway=GatewayConfig(port=ports[0], admin_key=ADMIN_KEY,
                                                        queue_timeout_s=QUEUE_TIMEOUT_S))
        self.system = LocalSystem(config, log_dir=self.work, log_level="WARNING", ephemeral=True)
        self.system.start_servers()
        for i in range(2 if self.args.engine == "sim" else 1):
            self.workers.append(self._start_worker(f"worker-{i}"))
        if self.args.embeddings:
            self.system.start_worker("worker-embed", engine="embeddings", dtype="float32", max_num_seqs=8,
                                     model=str(pull("all-minilm-l6-v2", model_cache_dir())),
                                     served_model_name=EMBED_MODEL)
        for i, port in enumerate(ports):
            self.system.start_gateway(f"gateway-{i}", port=port)
            self.gateways[f"gateway-{i}"] = port
        for port in ports:
            self.system.wait_until_ready(self.model, timeout_s=300, port=port)
            if self.args.embeddings:
                self.system.wait_until_ready(EMBED_MODEL, timeout_s=300, port=port)

    def _start_worker(self, name: str):
        settings = {"model": SIM_MODEL, "torch_threads": 1} if self.args.engine == "sim" else {}
        return self.system.start_worker(name, **settings)

    def urls(self) -> list[str]:
        return [self.system.url(port) for port in self.gateways.values()]

    def pids(self) -> dict[str, int]:
        """The running processes by name (a killed service stays in the system's list)."""
        gone = {s.name for s in self.system.services if not s.is_running()}
        return {name: pid for name, pid in self.system.pids().items() if name not in gone}

    # -- tenants ------------------------------------------------------------------------------------------------
    async def make_tenants(self) -> tuple[list[Tenant], str]:
        import asyncpg

        from switchyard.domain.tenancy import create_key, create_tenant

        tiers = ["enterprise", "pro", "pro", "free"]
        conn = await asyncpg.connect(self.system.config.database_url)
        tenants = []
        try:
            for i in range(self.args.tenants):
                tier, over = tiers[i % len(tiers)], i % 10 == 9
                name = f"soak-{i:04d}"
                await create_tenant(conn, name, tier, rpm_limit=6 if over else 10**6, tpm_limit=10**9)
                tenants.append(Tenant(name, tier, (await create_key(conn, name)).secret, over))
            await create_tenant(conn, "soak-probe", "enterprise", rpm_limit=10**6, tpm_limit=10**9)
            probe = (await create_key(conn, "soak-probe")).secret
        finally:
            await conn.close()
        return tenants, probe

    # -- faults -------------------------------------------------------------------------------------------------
    def fault(self, name: str) -> None:
        from switchyard.deploy.services import wait_until_ready

        if name == "worker-kill":
            victim = self.workers.pop(0)
            signal_tree(victim.pid, signal.SIGKILL)
            self.restarts += 1
            self.workers.append(self._start_worker(f"worker-r{self.restarts}"))
        elif name == "gateway-kill":
            victim_name = list(self.gateways)[-1]
            port = self.gateways.pop(victim_name)
            victim = next(s for s in self.system.services if s.name == victim_name)
            signal_tree(victim.pid, signal.SIGKILL)
            self.restarts += 1
            again = f"gateway-r{self.restarts}"
            started = self.system.start_gateway(again, port=port)
            self.gateways[again] = port
            wait_until_ready(self.system.url(port), self.model, 120, watch=[started])
        elif name == "nats-restart":
            self.system.restart_server("nats", down_s=5)
        elif name == "pg-stop":
            self.system.restart_server("postgres", down_s=20)
        elif name == "worker-stop":
            signal_tree(self.workers[0].pid, signal.SIGSTOP)
            time.sleep(30)
            signal_tree(self.workers[0].pid, signal.SIGCONT)
        else:
            raise ValueError(f"unknown fault {name!r}")

    def recovered(self, probe_key: str, timeout_s: float = 300) -> float | None:
        """Seconds until every gateway answers a probe chat; None if one does not within ``timeout_s``. A probe
        answered is billed, as any request: the ledger is told its id."""
        start = time.monotonic()
        body = {"model": self.model, "messages": [{"role": "user", "content": "probe"}], "max_tokens": 2}
        for url in self.urls():
            while True:
                try:
                    # As long as an enterprise request may wait: a probe sent while the worker restarts waits for it
                    # and is answered, not left behind as a billed row no client names.
                    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=PROBE_TIMEOUT_S,
                                   headers={"Authorization": f"Bearer {probe_key}"})
                    self.probes.append(Outcome("probe", "enterprise", time.time(), "refused", str(r.status_code),
                                               [r.headers.get("X-Request-Id", "")]))
                    if r.status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() - start > timeout_s:
                    return None
                time.sleep(0.25)
        return time.monotonic() - start

    # -- the run ------------------------------------------------------------------------------------------------
    def run(self) -> SoakResult:
        args = self.args
        result = SoakResult(cpu_lines(), args.minutes * 60)
        loop, load, thread = None, None, None
        try:
            self.start()
            tenants, probe = asyncio.run(self.make_tenants())
            load = Load(self.urls(), self.model, tenants, args.rate, args.active, args.churn,
                        embedding_model=EMBED_MODEL if args.embeddings else None)
            loop = asyncio.new_event_loop()
            # A daemon: a soak stopped early (Ctrl-C) stops its load below, and never waits on it to exit.
            thread = threading.Thread(target=loop.run_until_complete, args=(load.run(),), daemon=True)
            start = time.monotonic()
            result.started_wall = time.time()
            thread.start()
            faults = list(args.faults)
            next_fault = args.fault_every * 60 if faults else float("inf")
            next_sample = args.window * 60
            end = args.minutes * 60
            while (now := time.monotonic() - start) < end:
                if now >= next_fault:
                    run = FaultRun(faults[len(result.faults) % len(faults)], now)
                    print(f"{now / 60:6.1f} min  fault {run.name}", flush=True)
                    self.fault(run.name)
                    run.ended_at = time.monotonic() - start
                    run.recovered_s = self.recovered(probe)
                    print(f"{(time.monotonic() - start) / 60:6.1f} min  recovered in {run.recovered_s} s", flush=True)
                    result.faults.append(run)
                    next_fault += args.fault_every * 60
                if now >= next_sample:
                    result.samples.append(self._sample(now))
                    next_sample += args.window * 60
                time.sleep(min(1.0, max(0.0, min(next_fault, next_sample, end) - now)))
            loop.call_soon_threadsafe(load.stop)
            thread.join()
            loop.close()
            result.samples.append(self._sample(time.monotonic() - start))
            if args.quiet:  # what the processes still hold of tenants once every one of them has left
                time.sleep(args.quiet)
                result.samples.append(self._sample(time.monotonic() - start))
            result.ledger, result.tenants_left = load.ledger, len(load.left)
            nats_url, database_url = self.system.config.nats_url, self.system.config.database_url
            records, dups = asyncio.run(usage_duplicates(nats_url))
            result.usage_duplicates = dups[:10]
            result.check = asyncio.run(check_ledger(load.ledger, database_url, nats_url, len(dups),
                                                    also_named=[rid for p in self.probes for rid in p.request_ids]))
            result.prompts = asyncio.run(prompt_tokens_by_time(database_url, self.model))
            if args.keep:  # each request as its client saw it, beside the logs and the data
                with open(self.work / "ledger.jsonl", "w") as f:
                    f.writelines(json.dumps(dataclasses.asdict(out)) + "\n" for out in load.ledger)
            return result
        finally:
            if thread is not None and thread.is_alive() and loop is not None and load is not None:
                loop.call_soon_threadsafe(load.stop)  # stopped early: the load first, then the system
                thread.join(timeout=30)
            self.stop()

    def _sample(self, at: float) -> Sample:
        gateways = {name: self.system.url(port) for name, port in self.gateways.items()}
        s = asyncio.run(sample(at, self.pids(), self.system.config.nats_url, self.system.config.database_url,
                               self.work, gateways))
        memory = sum(m for m, _ in s.processes.values()) / 2**20
        print(f"{at / 60:6.1f} min  sample: {len(s.processes)} processes, {memory:.0f} MiB (PSS), "
              f"{sum(f for _, f in s.processes.values())} fds", flush=True)
        return s

    def stop(self) -> None:
        for worker in self.workers:  # a stopped worker would not stop
            try:
                signal_tree(worker.pid, signal.SIGCONT)
            except AssertionError:
                pass
        if self.system is not None:
            self.system.stop()
        if not self.args.keep:
            shutil.rmtree(self.work, ignore_errors=True)


def parse_args(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=120.0)
    parser.add_argument("--engine", choices=["sim", "smollm2"], default="sim")
    parser.add_argument("--rate", type=float, default=6.0, help="requests per second, open loop")
    parser.add_argument("--tenants", type=int, default=500)
    parser.add_argument("--active", type=int, default=60, help="tenants sending at any time")
    parser.add_argument("--churn", type=float, default=10.0, help="seconds between a tenant leaving and another "
                                                                 "coming")
    parser.add_argument("--faults", nargs="*", default=FAULTS, choices=FAULTS)
    parser.add_argument("--fault-every", type=float, default=10.0, help="minutes")
    parser.add_argument("--window", type=float, default=10.0, help="minutes per reported window")
    parser.add_argument("--quiet", type=float, default=130.0,
                        help="seconds without traffic after the load, then a last sample: state kept per tenant for "
                             "a minute must be gone by then (swept every minute)")
    parser.add_argument("--no-embeddings", dest="embeddings", action="store_false",
                        help="no embedding worker (all-MiniLM-L6-v2, pulled into the tests' model cache)")
    parser.add_argument("--kv-offload-gib", type=float, default=None,
                        help="the SmolLM2 worker's host KV tier, GiB of tmpfs (off by default on a CPU worker): what "
                             "a killed worker computed is found there by its replacement")
    parser.add_argument("--keep", action="store_true",
                        help="keep the work dir (logs, the data, ledger.jsonl: each request as its client saw it)")
    parser.add_argument("--results", default=None, help="markdown file to append to; '-' for none")
    args = parser.parse_args(argv)
    if args.kv_offload_gib is not None and args.engine != "smollm2":
        parser.error("--kv-offload-gib is the SmolLM2 worker's (the simulated engine keeps no KV)")
    return args


def _interrupted(signum, frame) -> None:
    raise KeyboardInterrupt


def main() -> None:
    from bench.soak_report import report

    args = parse_args()
    if args.results != "-" and importlib.util.find_spec("matplotlib") is None:
        # Known before hours of load, not after: a recorded run's plot is part of its result (a two-hour run lost
        # its plot this way).
        raise SystemExit("bench/soak.py: a run appended to bench/RESULTS.md draws its plot with matplotlib, which is "
                         "not installed: pip install -e '.[bench]' (or --results - for a run not recorded)")
    print("\n".join(cpu_lines()), flush=True)
    signal.signal(signal.SIGTERM, _interrupted)  # a soak killed stops what it started, as one interrupted does
    result = Soak(args).run()
    report(result, args)


if __name__ == "__main__":
    main()
