"""Thousands of tenants in one tier, the model taken out: does fair share hold, what do per-tenant queues cost the
worker and NATS, and what does an idle tenant cost?

    .venv/bin/python bench/tenants.py                        # 10,000 tenants, 1,000 active at once, 60 s
    .venv/bin/python bench/tenants.py --tenants 2000 --active 200 --seconds 30
    .venv/bin/python bench/tenants.py --tokens 400 --tokens-per-delta 20    # on a 2-core machine (see below)
    .venv/bin/python bench/tenants.py --tokens 400 --tokens-per-delta 20 --pause-after-tokens 256  # off vs on

The engine is the simulated one (workers/simulated_engine.py, a test double): ``--seats`` sequences at ``--rate``
tokens/s (20), each request about ``--tokens`` (40: 2 s; each 0.5-1.5x that, as real lengths vary),
``--tokens-per-delta`` to a message after the first, the engine stepping every ``--engine-step-ms`` (20: a real
engine at a large batch; a new request's first token goes out at once). With every seat taken that is 256
requests and 10,240 deltas a second through one gateway: more than a 2-core machine running clients, gateway, NATS,
Postgres and worker together relays (bench/streams.py), so there longer requests sent in larger deltas keep the
seats full at a rate the machine carries. Keys for ``--tenants`` tenants are made in
Postgres. Then, on the pro tier:

1. idle: a light tenant L alone, a short request (8 tokens) every 2 s: its TTFT p95 is the reference;
2. loaded: ``--active`` tenants each keep one 40-token stream going (closed loop) and a heavy tenant H keeps
   ``--heavy`` going, far more than the seats: L, at the same pace as alone and well under its fair share of the
   seats, must still get in (its TTFT p95 within 3x the idle figure: it is the least served tenant, and the worker
   pulls for it first). L's requests are reported in two parts: those sent in the first round, while the active
   tenants, all arriving at once, have each yet to start a first request (tenants that have had nothing rank
   before one that has had a little: L waits its turn among them), and those sent after it (the target);
3. idle again: the consumers the active tenants left behind (one per tenant, queue and model, deleted by JetStream
   after an idle hour) and what they cost while nobody sends: NATS's memory, the worker's CPU.

Reported: L's TTFT p50/p95 idle and loaded (first round, after it), the first round's length, requests served per
tenant class, JetStream consumers on the tier's stream, the worker's NATS subscriptions, the worker's queue time
p95 (its metric), the share of the worker's time spent pulling (py-spy over the loaded phase: samples inside the
intake's pulls), NATS memory and worker CPU per
idle tenant, the gateway's event-loop lag over the loaded phase (its metric) and the CPU each part used then (in
cores: on a small machine everything shares, and a loop that waits for a core shows here). Clients run in processes
of their own, L's apart from the closed loops (whose thousand streams would otherwise delay L's on one event loop);
the closed loops run at ``--client-nice`` 10, standing for clients on other machines. ``lscpu`` is printed and the
CPU named with the table.

Pausing (scheduler/pausing.py): the tier's ``pause_after_tokens`` is left at its default unless
``--pause-after-tokens N`` is given; then the whole measure runs twice, on a fresh system each, with pausing off (0)
and at N, and a table compares them: L's TTFT p95 loaded against its idle figure, and the tier's output tokens a
second over the loaded phase (the worker's ``generation_tokens``; target: with pausing at least 90% of without),
with the pauses the worker made.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, lscpu  # noqa: E402
from bench.proc import cpu_seconds, machine_busy_seconds, profile, rss_bytes, tree_cpu_seconds  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from bench.tenants_load import LoadReport, run_load  # noqa: E402

ADMIN_KEY = "bench-tenants-admin"
TIER = "pro"
MODEL = "sim"
TOKENS = 40  # an active or heavy tenant's request (--tokens)
LIGHT_TOKENS = 8  # L's


def start_system(work: Path, seats: int, rate: float = 20.0, tokens_per_delta: int = 1, step_ms: float = 0.0):
    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
    from tests.support.system import free_port

    config = SwitchyardConfig(data_dir=work, gateway=GatewayConfig(port=free_port(), admin_key=ADMIN_KEY,
                                                                    queue_timeout_s=600, affinity=False),
                              worker=WorkerConfig(engine="simulated", heartbeat_s=1.0))
    system = LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True)
    system.start_servers()
    system.start_worker("worker-sim", model=MODEL, max_num_seqs=seats, simulated_tokens_per_s=rate,
                        simulated_tokens_per_delta=tokens_per_delta, simulated_step_ms=step_ms)
    system.start_gateway()
    system.wait_until_ready(MODEL, timeout_s=120)
    return system


async def make_tenants(database_url: str, base_url: str, count: int, pause_after: int | None = None) -> list[str]:
    """``count`` tenants on the tier, a key each, without per-key limits; the tier's queues opened wide, and its
    pausing quantum set to ``pause_after`` (None: left as it is)."""
    import asyncpg
    import httpx

    from switchyard.domain.tenancy import create_key, create_tenant

    policy: dict[str, float] = {"max_queued": 100_000, "max_queued_per_tenant": 1_000, "max_wait_s": 600}
    if pause_after is not None:
        policy["pause_after_tokens"] = pause_after
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.put(f"{base_url}/admin/tiers/{TIER}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                           json=policy)
        r.raise_for_status()
    conn = await asyncpg.connect(database_url)
    keys = []
    try:
        for i in range(count):
            name = f"tenant-{i:05d}"
            await create_tenant(conn, name, TIER, rpm_limit=2**31 - 1, tpm_limit=2**31 - 1)
            keys.append((await create_key(conn, name)).secret)
    finally:
        await conn.close()
    return keys


async def jetstream_counts(system) -> tuple[int, int]:
    """(consumers on the tier's request stream, subscriptions of the worker's NATS connection)."""
    import httpx
    import nats

    from switchyard.shared import subjects

    nc = await nats.connect(system.config.nats_url)
    try:
        consumers = (await nc.jetstream().stream_info(subjects.request_stream(TIER))).state.consumer_count
    finally:
        await nc.close()
    nats_server = system.nats
    async with httpx.AsyncClient(timeout=10) as http:
        conns = (await http.get(f"{nats_server.monitor_url}/connz?limit=1000")).json()["connections"]
    worker_subs = sum(c.get("subscriptions", 0) for c in conns
                      if c.get("name", "").startswith("switchyard-worker"))
    return consumers, worker_subs


def worker_queue_time_p95(worker_metrics: str) -> float:
    """The worker's own queue-time histogram (published to admitted), its 95th percentile bucket bound."""
    return bucket_quantile([], histogram(worker_metrics, "switchyard:request_queue_time_seconds", tier=TIER)[0],
                           0.95)


async def _metrics_url(system) -> str:
    import nats

    from switchyard.shared.jetstream import live_workers

    nc = await nats.connect(system.config.nats_url)
    try:
        (info,) = [w for w in await live_workers(nc.jetstream()) if w.model == MODEL]
        return info.metrics_url
    finally:
        await nc.close()


def load(system, keys: dict[str, list[str]], seconds: float, clients: int, tokens: int = TOKENS,
         nice: int = 0) -> LoadReport:
    """Run the clients in processes of their own, their merged report: the light tenant's paced requests in one
    (its TTFT is the measure: it must not wait on the event loop of a thousand other streams), every closed loop
    spread over ``clients`` more at ``nice`` (they stand for clients on other machines: on one machine they take
    the cores the platform leaves, rather than take them from it)."""
    context = multiprocessing.get_context("spawn")
    shares = [({"light": keys["light"]}, 0)] if keys.get("light") else []
    loops = {role: ks for role, ks in keys.items() if role != "light"}
    if loops:
        shares += [({role: ks[i::clients] for role, ks in loops.items()}, nice) for i in range(clients)]
    pipes, procs = [], []
    for share, niceness in shares:
        recv, send = context.Pipe(duplex=False)
        proc = context.Process(target=run_load, args=(system.url(), MODEL, tokens, LIGHT_TOKENS, share, seconds,
                                                      send, niceness))
        proc.start()
        send.close()  # the child holds the only write end: a client that dies is an EOFError here, not a hang
        pipes.append(recv)
        procs.append(proc)
    reports = [p.recv() for p in pipes]
    for proc in procs:
        proc.join()
    return LoadReport.merged(reports)


class CpuShares:
    """CPU the system's parts and the clients use over a phase, in cores: which part a slow loop waits on."""

    def __init__(self, system) -> None:
        by_name = {s.name: s.pid for s in system.services}
        self._pids = {"gateway": by_name["gateway"], "worker": by_name["worker-sim"], "jobs": by_name.get("jobs"),
                      "NATS": system.nats.pid, "Postgres": system.postgres.pid}

    def __enter__(self) -> CpuShares:
        self._started = time.perf_counter()
        self._before = self._read()
        return self

    def __exit__(self, *exc_info) -> None:
        seconds = time.perf_counter() - self._started
        after = self._read()
        self.cores = {part: (after[part] - self._before[part]) / seconds for part in after}

    def _read(self) -> dict[str, float]:
        # The client processes once joined, and py-spy's run (it profiles the worker meanwhile): children waited for.
        usage = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = {part: tree_cpu_seconds(pid) for part, pid in self._pids.items() if pid is not None}
        out["clients and py-spy"] = usage.ru_utime + usage.ru_stime
        out["machine"] = machine_busy_seconds()
        return out

    def line(self) -> str:
        parts = " / ".join(f"{part} {self.cores[part]:.2f}" for part in self.cores if part != "machine")
        return f"{parts}; whole machine {self.cores['machine']:.2f} of {os.cpu_count()}"


async def usage_rows(database_url: str, request_ids: list[str]) -> dict[str, dict]:
    """Each request's usage row (when the gateway accepted it, its queue time), once the billing writer has written
    them all (at most 30 s)."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        deadline = time.monotonic() + 30
        while True:
            rows = await conn.fetch("SELECT request_id, extract(epoch FROM created_at)::float8 AS accepted_at, "
                                    "queue_ms FROM requests WHERE request_id = ANY($1)", request_ids)
            if len(rows) >= len(request_ids) or time.monotonic() > deadline:
                return {r["request_id"]: dict(r) for r in rows}
            await asyncio.sleep(1)
    finally:
        await conn.close()


def ttft_parts(requests: list[tuple[float, float, str]], rows: dict[str, dict]) -> str:
    """Where L's TTFT went, in ms: before the gateway accepted the request (the client's send, the gateway's
    parsing, authentication and admission), in the worker's queue (JetStream, the pull, a free seat), and the rest
    (the worker's first token back through NATS and the gateway to the client). Medians over every request, then
    means over its slowest 5%."""
    parts = sorted((ttft, rows[rid]["accepted_at"] - sent, rows[rid]["queue_ms"] / 1e3)
                   for sent, ttft, rid in requests if rid in rows)
    if not parts:
        return "no usage rows"
    split = [(before, queue, ttft - before - queue) for ttft, before, queue in parts]
    slowest = split[-max(1, len(split) // 20):]
    medians = [statistics.median(p[i] for p in split) for i in range(3)]
    means = [sum(p[i] for p in slowest) / len(slowest) for i in range(3)]
    return (" / ".join(f"{1e3 * v:.0f}" for v in medians) + f"; slowest {len(slowest)}: "
            + " / ".join(f"{1e3 * v:.0f}" for v in means))


def read_metrics(system) -> dict[str, str]:
    """The gateway's and the worker's Prometheus text, by part."""
    import httpx

    worker_url = asyncio.run(_metrics_url(system))
    return {"gateway": httpx.get(f"{system.url()}/metrics", timeout=30).text,
            "worker": httpx.get(worker_url, timeout=30).text}


def histogram(text: str, metric: str, **labels: str) -> tuple[list[tuple[float, float]], float]:
    """A histogram in Prometheus text, its series with ``labels`` added up: its buckets, (bound, observations at or
    under it), and the sum of its observations."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if any(sample.labels.get(k) != v for k, v in labels.items()):
                continue
            if sample.name == f"{metric}_bucket":
                le = float(sample.labels["le"])
                buckets[le] = buckets.get(le, 0.0) + sample.value
            elif sample.name == f"{metric}_sum":
                total += sample.value
    return sorted(buckets.items()), total


def counter_total(text: str, metric: str, **labels: str) -> float:
    """A counter in Prometheus text, its series with ``labels`` added up."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in (metric, f"{metric}_total") and all(sample.labels.get(k) == v
                                                                    for k, v in labels.items()):
                total += sample.value
    return total


def bucket_quantile(before: list[tuple[float, float]], after: list[tuple[float, float]], q: float) -> float:
    """The ``q`` quantile's bucket bound of the observations made between two reads of the histogram."""
    counts = [(le, n - dict(before).get(le, 0.0)) for le, n in sorted(after)]
    total = counts[-1][1] if counts else 0
    return next((le for le, n in counts if total and n >= q * total), float("nan"))


def gc_line(before: str, after: str) -> str:
    """A process's full collections between two reads of its metrics: how many, the longest (bucket bound) and
    their time in all."""
    (b0, s0), (b1, s1) = (histogram(t, "switchyard:gc_pause_seconds", generation="2") for t in (before, after))
    count = (b1[-1][1] - (b0[-1][1] if b0 else 0.0)) if b1 else 0.0  # the +Inf bucket: every observation
    return f"{count:.0f} / {bucket_quantile(b0, b1, 1.0):g} / {s1 - s0:.2f}" if count else "0"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tenants", type=int, default=10_000)
    p.add_argument("--active", type=int, default=1_000)
    p.add_argument("--heavy", type=int, default=200, help="streams the heavy tenant keeps going")
    p.add_argument("--seats", type=int, default=512)
    p.add_argument("--seconds", type=float, default=60.0, help="each phase")
    p.add_argument("--rate", type=float, default=20.0, help="tokens/s of each sequence")
    p.add_argument("--tokens", type=int, default=TOKENS,
                   help="an active or heavy tenant's request (longer ones: fewer requests a second for the same seats)")
    p.add_argument("--tokens-per-delta", type=int, default=1,
                   help="tokens a delta carries after the first (fewer messages for the same tokens: on a small "
                        "machine the relay's cost per message, not the worker, bounds a run with every seat taken)")
    p.add_argument("--engine-step-ms", type=float, default=20.0,
                   help="how often the simulated engine steps (as bench/streams.py; 0: whenever a token is due)")
    p.add_argument("--clients", type=int, default=2, help="client processes for the closed loops (L has its own)")
    p.add_argument("--client-nice", type=int, default=10,
                   help="nice value of the closed loops' processes (0: compete with the platform for its cores)")
    p.add_argument("--pause-after-tokens", type=int, default=None, metavar="N",
                   help="run twice, pausing off and at N tokens (the tier's pause_after_tokens), and compare; "
                        "unset: once, at the tier's default")
    p.add_argument("--results", default=str(RESULTS), help="'-' to skip")
    args = p.parse_args()
    cpu = cpu_name(lscpu())  # printed
    arms = [None] if args.pause_after_tokens is None else [0, args.pause_after_tokens]
    sections, outcomes = [], []
    for pause_after in arms:
        text, outcome = run_arm(args, cpu, pause_after)
        print(text, flush=True)
        sections.append(text)
        outcomes.append(outcome)
    if len(arms) == 2:
        (off, on) = outcomes
        ratio = on["tok_s"] / max(1e-9, off["tok_s"])
        table = markdown_table(
            ("pausing", "L TTFT p95 alone (ms)", "L p95 loaded after the first round (ms)", "p95 loaded / alone",
             "second half p95 / alone", "output tok/s loaded (tier)", "pauses", "requests served: L / H / active"),
            [(name, f"{o['alone_p95']:.0f}", f"{o['loaded_p95']:.0f}", f"{o['ratio']:.2f}x", f"{o['late_ratio']:.2f}x",
              f"{o['tok_s']:,.0f}", f"{o['pauses']:.0f}", o["served"])
             for name, o in (("off", off), (f"after {args.pause_after_tokens} tokens", on))])
        summary = (f"## Tenants in one tier, pausing off vs on (simulated engine), {cpu}, {os.cpu_count()} cores\n\n"
                   f"`{command_line()}`\n\n" + table
                   + f"\n\n- light tenant with pausing: p95 loaded {on['ratio']:.2f}x its idle figure (target <= 3x): "
                   + ("MET" if on["ratio"] <= 3 else "NOT MET")
                   + f"\n- output tok/s with pausing / without: {ratio:.1%} (target >= 90%): "
                   + ("MET" if ratio >= 0.9 else "NOT MET") + "\n")
        print(summary)
        sections = [summary] + [t.replace("## Tenants in one tier", "### Tenants in one tier", 1) for t in sections]
    for text in sections:
        append_section(text, args.results)


def run_arm(args, cpu: str, pause_after: int | None) -> tuple[str, dict]:
    """One whole measure on a fresh system, the tier's pausing at ``pause_after`` tokens (0: off; None: its
    default): its section for RESULTS.md, and the figures the comparison of arms reads."""
    work = Path(tempfile.mkdtemp(prefix="switchyard-bench-tenants-"))
    os.chmod(work, 0o755)
    system = start_system(work, args.seats, args.rate, args.tokens_per_delta, args.engine_step_ms)
    try:
        t0 = time.perf_counter()
        all_keys = asyncio.run(make_tenants(system.config.database_url, system.url(), args.tenants + 2, pause_after))
        made_s = time.perf_counter() - t0
        light, heavy, rest = all_keys[0], all_keys[1], all_keys[2:]
        worker = next(s.pid for s in system.services if s.name == "worker-sim")
        nats_pid = system.nats.pid
        alone = load(system, {"light": [light]}, args.seconds / 2, 1)
        print("idle:", alone.summary(), flush=True)
        spied: list[tuple[str, dict]] = []

        def spy() -> None:
            try:
                spied.append(profile(worker, args.seconds / 3, top=20, watch=("TenantQueues.take_many",)))
            except Exception as exc:  # the figures without a profile, rather than no figures
                spied.append((f"(profile failed: {exc!r})", {}))

        spying = threading.Timer(args.seconds / 3, spy)
        spying.start()
        loaded_at = time.time()
        metrics_before = read_metrics(system)
        loaded_started = time.perf_counter()
        with CpuShares(system) as cpu_loaded:
            loaded = load(system, {"light": [light], "heavy": [heavy] * args.heavy, "active": rest[:args.active]},
                          args.seconds, args.clients, args.tokens, args.client_nice)
        loaded_s = time.perf_counter() - loaded_started
        metrics_after = read_metrics(system)
        spying.join()
        print("loaded:", loaded.summary(), flush=True)
        steady = loaded.light_requests("steady")
        rows = asyncio.run(usage_rows(system.config.database_url, [rid for _, _, rid in steady]))
        consumers, subs = asyncio.run(jetstream_counts(system))
        queue_p95 = worker_queue_time_p95(metrics_after["worker"])
        # Idle: what the consumers left behind cost while nobody sends.
        time.sleep(3)
        cpu_before, nats_rss = cpu_seconds(worker), rss_bytes(nats_pid)
        time.sleep(10)
        idle_cpu = (cpu_seconds(worker) - cpu_before) / 10
        report, shares = spied[0]
        pull_share = shares.get("TenantQueues.take_many", 0.0)
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    lag_before, lag_after = (histogram(t["gateway"], "switchyard:event_loop_lag_seconds")[0]
                             for t in (metrics_before, metrics_after))
    admitted_before, admitted_after = (histogram(t["gateway"], "switchyard:admission_seconds", outcome="admitted")[0]
                                       for t in (metrics_before, metrics_after))
    # Every seat taken, L first in line: it waits for the next request to end. Ends of requests of spread lengths
    # come about as a Poisson stream, so that wait's p95 is about 3 (ln 20) times their mean interval.
    free_every_ms = 1e3 * args.seconds / max(1, sum(loaded.served.values()))
    ratio = loaded.light_ttft(95, "steady") / max(1e-9, alone.light_ttft(95))
    generated, pauses = ((counter_total(metrics_after["worker"], metric, **labels)
                          - counter_total(metrics_before["worker"], metric, **labels))
                         for metric, labels in (("switchyard:generation_tokens", {"tier": TIER}),
                                                ("switchyard:num_pauses", {})))
    tok_s = generated / max(1e-9, loaded_s)
    first_round_s = (loaded.first_round_end or float("nan")) - loaded_at
    settled_s = loaded.settled_at() - loaded_at
    table = markdown_table(
        ("measure", "value"),
        [("tenants with keys (made in)", f"{args.tenants + 2:,} ({made_s:.0f} s)"),
         ("active at once: tenants / heavy streams / seats", f"{args.active:,} / {args.heavy} / {args.seats}"),
         ("L TTFT p50 / p95 alone (ms)", f"{1e3 * alone.light_ttft(50):.0f} / {1e3 * alone.light_ttft(95):.0f}"),
         ("first round: every active tenant's first request started within (s)",
          f"{first_round_s:.1f}" + (f" ({loaded.unserved_active} never)" if loaded.unserved_active else "")),
         ("L's requests queued in it served within (s)", f"{settled_s:.1f}"),
         (f"L TTFT p50 / p95 loaded, first round ({loaded.light_count('first')} requests, ms)",
          f"{1e3 * loaded.light_ttft(50, 'first'):.0f} / {1e3 * loaded.light_ttft(95, 'first'):.0f}"),
         (f"L TTFT p50 / p95 loaded, after it ({loaded.light_count('steady')} requests, ms)",
          f"{1e3 * loaded.light_ttft(50, 'steady'):.0f} / {1e3 * loaded.light_ttft(95, 'steady'):.0f}"),
         ("L p95 loaded after the first round / alone (target <= 3x)", f"{ratio:.2f}x"),
         ("pausing (the tier's pause_after_tokens) / pauses loaded",
          f"{'default' if pause_after is None else pause_after or 'off'} / {pauses:.0f}"),
         ("the tier's output tokens a second, loaded (the worker's generation_tokens)", f"{tok_s:,.0f}"),
         (f"L TTFT p50 / p95 loaded, second half of the phase ({loaded.light_count('late')} requests, ms; p95 / "
          "alone)", f"{1e3 * loaded.light_ttft(50, 'late'):.0f} / {1e3 * loaded.light_ttft(95, 'late'):.0f} "
          f"({loaded.light_ttft(95, 'late') / max(1e-9, alone.light_ttft(95)):.2f}x)"),
         ("L's TTFT after the first round in parts (ms), medians; means of its slowest 5%: before the gateway "
          "accepted it (admission) / worker queue / the rest", ttft_parts(steady, rows)),
         ("a seat freed every (ms, loaded) / so L's wait for the next one, p95 (ms)",
          f"{free_every_ms:.0f} / {3 * free_every_ms:.0f}"),
         ("requests served loaded: L / H / active tenants", loaded.served_line()),
         ("requests failed loaded", str(loaded.failed)),
         ("gateway event-loop lag loaded, p50 / p99 (bucket bound, s)",
          f"{bucket_quantile(lag_before, lag_after, 0.5):g} / {bucket_quantile(lag_before, lag_after, 0.99):g}"),
         ("gateway admission loaded, p50 / p95 / p99 (bucket bound, s)",
          " / ".join(f"{bucket_quantile(admitted_before, admitted_after, q):g}" for q in (0.5, 0.95, 0.99))),
         *((f"{part} full GCs loaded: count / longest (bucket bound, s) / in all (s)",
            gc_line(metrics_before[part], metrics_after[part])) for part in ("gateway", "worker")),
         (f"CPU loaded, cores (closed-loop clients at nice {args.client_nice})", cpu_loaded.line()),
         ("JetStream consumers on the tier's stream", f"{consumers:,}"),
         ("worker NATS subscriptions", f"{subs:,}"),
         ("worker queue time p95 (bucket bound, s)", f"{queue_p95:g}"),
         ("worker time in pulls, loaded (target < 5%)", f"{pull_share:.1%}"),
         ("NATS RSS with the idle consumers (MB) / per idle tenant (KB)",
          f"{nats_rss / 2**20:.0f} / {nats_rss / 1024 / max(1, consumers):.1f}"),
         ("worker CPU while idle, with them", f"{idle_cpu:.1%} of a core")])
    text = (f"## Tenants in one tier (simulated engine), {cpu}, {os.cpu_count()} cores\n\n`{command_line()}`\n\n"
            + table + f"\n\nWorker profile, loaded phase:\n\n```\n{report}\n```\n")
    late_ratio = loaded.light_ttft(95, "late") / max(1e-9, alone.light_ttft(95))
    return text, {"alone_p95": 1e3 * alone.light_ttft(95), "loaded_p95": 1e3 * loaded.light_ttft(95, "steady"),
                  "ratio": ratio, "late_ratio": late_ratio, "tok_s": tok_s, "pauses": pauses,
                  "served": loaded.served_line()}


if __name__ == "__main__":
    main()
