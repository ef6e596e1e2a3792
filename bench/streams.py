"""Concurrent streams through the platform, the model taken out: how many one gateway process relays, at what added
latency, CPU and memory, and what N processes on one port (``--gateways N``) add.

    .venv/bin/python bench/streams.py                                    # the ramp below, 1 then 2 gateways
    .venv/bin/python bench/streams.py --steps 100:20 1000:20 --gateways 1 --profile

The model is the simulated engine (workers/simulated_engine.py, a test double): each stream gets ``rate`` tokens a
second, its first token as soon as the worker adds it, so everything a client waits for beyond that is the
platform's: gateway, NATS, the worker's intake and publishing. The engine steps every ``--engine-step-ms`` (20 ms:
a real engine at a large batch), a token of every sequence due in each step, so a worker sends each gateway one
message a step, as it would with a real model. A step ``S:R`` opens S streams at R
tokens/s each, started evenly over ``--ramp`` seconds (longer for a large step: at most ``--open-per-s`` a second),
each lasting until ``--seconds`` after the last has started, so that all of them are open together, through the
official ``openai`` client (async, streaming, ``include_usage``) in ``--clients`` processes of their own. Per step:

* completed / failed streams (a stream fails on any error, or fewer tokens than asked);
* relayed tokens/s: tokens the clients got over the step's wall time;
* added TTFT p50/p99: send to first content (the simulated first-token time is 0); added gap p99: a stream's gaps
  between content chunks beyond 1/R (a sample of 20 per stream, reservoir-drawn);
* gateway CPU per relayed token and memory per 1,000 open streams (peak RSS over the step, minus before it),
  summed over its processes; NATS, worker and client CPU as a share of one core over the step;
* with ``--profile``: where the gateway's time goes in the largest 20-token/s step (py-spy, self and inclusive).

Everything runs on this machine: client, gateway, NATS and worker share its cores, so the figures bound what a
gateway process does with what is left; ``lscpu`` is printed and the CPU named with the table (bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import resource
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, lscpu, unlimited_keys  # noqa: E402
from bench.proc import PeakRss, cpu_seconds, profile, rss_bytes  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from bench.streams_client import ClientReport, run_client  # noqa: E402

ADMIN_KEY = "bench-streams-admin"
TIER = "enterprise"


def parse_step(text: str) -> tuple[int, float]:
    streams, _, rate = text.partition(":")
    return int(streams), float(rate or 20)


def model_of(rate: float) -> str:
    return f"sim-{rate:g}"


def start_system(work: Path, gateways: int, rates: dict[float, int], engine_step_ms: float = 0.0):
    """Embedded NATS and Postgres, a simulated worker per rate (seats for its largest step), ``gateways`` gateway
    processes on one port; returns the system and its keys."""
    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
    from tests.support.system import free_port

    config = SwitchyardConfig(data_dir=work, gateway=GatewayConfig(port=free_port(), admin_key=ADMIN_KEY,
                                                                    processes=gateways, queue_timeout_s=300),
                              worker=WorkerConfig(engine="simulated", heartbeat_s=1.0,
                                                  simulated_step_ms=engine_step_ms))
    system = LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True)
    system.start_servers()
    for rate, seats in rates.items():
        system.start_worker(f"worker-{model_of(rate)}", model=model_of(rate), max_num_seqs=seats,
                            simulated_tokens_per_s=rate)
    system.start_gateway()
    for rate in rates:
        system.wait_until_ready(model_of(rate), timeout_s=120)
    asyncio.run(_open_tier(system.url(), max(rates.values())))
    keys = asyncio.run(unlimited_keys(config.database_url, TIER, *(f"streams-{i}" for i in range(16))))
    return system, keys


async def _open_tier(base_url: str, streams: int) -> None:
    """Queue caps that a ramp of ``streams`` requests never meets (the benchmark measures relaying, not refusals)."""
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.put(f"{base_url}/admin/tiers/{TIER}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                           json={"max_queued": 4 * streams + 1000, "max_queued_per_tenant": 4 * streams + 1000})
        r.raise_for_status()


def run_step(system, keys: list[str], streams: int, rate: float, args, profile_it: bool) -> dict:
    gateways = [s.pid for s in system.services if s.name.startswith("gateway")]
    worker = next(s.pid for s in system.services if s.name == f"worker-{model_of(rate)}")
    nats = system.nats.pid
    before = {"gateway": sum(map(cpu_seconds, gateways)), "nats": cpu_seconds(nats), "worker": cpu_seconds(worker)}
    rss_before = sum(map(rss_bytes, gateways))
    peak = PeakRss(gateways)
    ramp = step_ramp(streams, args)
    context = multiprocessing.get_context("spawn")
    pipes, procs = [], []
    share = [streams // args.clients + (i < streams % args.clients) for i in range(args.clients)]
    spied: list[str] = []
    if profile_it:  # the middle of the step, once every stream is open
        threading.Timer(ramp + 1,
                        lambda: spied.append(profile(gateways[0], max(2, args.seconds / 2))[0])).start()
    started = time.perf_counter()
    for i, count in enumerate(share):
        recv, send = context.Pipe(duplex=False)
        proc = context.Process(target=run_client, args=(system.url(), keys, model_of(rate), count, rate,
                                                         args.seconds, ramp, i, send, args.client_nice))
        proc.start()
        send.close()  # the child holds the only write end: a client that dies is an EOFError here, not a hang
        pipes.append(recv)
        procs.append(proc)
    reports: list[ClientReport] = [pipe.recv() for pipe in pipes]
    wall = time.perf_counter() - started
    for proc in procs:
        proc.join()
    rss_peak = peak.stop()
    used = {"gateway": sum(map(cpu_seconds, gateways)) - before["gateway"],
            "nats": cpu_seconds(nats) - before["nats"], "worker": cpu_seconds(worker) - before["worker"],
            "client": sum(r.cpu_s for r in reports)}
    results = [r for report in reports for r in report.results]
    ok = [r for r in results if r.ok]
    relayed = sum(r.tokens for r in ok)
    gaps = sorted(g - 1 / rate for r in ok for g in r.gaps_s) or [0.0]
    ttfts = sorted(r.ttft_s for r in ok) or [0.0]
    errors = sorted({r.error for r in results if not r.ok})
    while profile_it and not spied:
        time.sleep(0.2)
    return {
        "streams": streams, "rate": rate, "ok": len(ok), "failed": len(results) - len(ok), "errors": errors[:3],
        "relayed_tok_s": relayed / wall, "ttft_p50_ms": 1e3 * _pct(ttfts, 50), "ttft_p99_ms": 1e3 * _pct(ttfts, 99),
        "gap_p99_ms": 1e3 * _pct(gaps, 99), "gateway_us_per_token": 1e6 * used["gateway"] / max(1, relayed),
        "gateway_mb_per_1k": (rss_peak - rss_before) / 2**20 / (streams / 1000),
        **{f"{k}_cpu": used[k] / wall for k in used}, "profile": spied[0] if spied else "",
    }


def step_ramp(streams: int, args) -> float:
    """Over how many seconds a step's streams start: ``--ramp``, or longer so that at most ``--open-per-s`` start a
    second (opening is admission's work, not relaying's)."""
    return max(args.ramp, streams / args.open_per_s)


def _pct(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(len(values) * q / 100))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", nargs="+", default=["100:20", "1000:20", "2000:20", "5000:4", "10000:1"],
                   help="STREAMS:TOKENS_PER_S per step (default: the ramp of issue 28)")
    p.add_argument("--gateways", type=int, nargs="+", default=[1, 2], help="gateway processes, one run each")
    p.add_argument("--seconds", type=float, default=15.0,
                   help="how long a step's streams are all open together, after the last one started")
    p.add_argument("--ramp", type=float, default=5.0, help="seconds over which a step's streams start, at least")
    p.add_argument("--open-per-s", type=float, default=200.0,
                   help="streams started a second, at most (a larger step's ramp is longer)")
    p.add_argument("--clients", type=int, default=2, help="client processes")
    p.add_argument("--client-nice", type=int, default=0,
                   help="the clients' niceness: 10 stands for clients on other machines, which take no core from "
                        "the platform (their own latency then includes waiting for the cores it leaves)")
    p.add_argument("--engine-step-ms", type=float, default=20.0,
                   help="how often the simulated engine steps, every sequence's due token in one step, as a real "
                        "engine at a large batch does (0: whenever a token is due, hundreds of steps a second)")
    p.add_argument("--profile", action="store_true", help="py-spy the gateway in the largest 20 tok/s step")
    p.add_argument("--results", default=str(RESULTS), help="'-' to skip")
    args = p.parse_args()
    steps = [parse_step(s) for s in args.steps]
    cpu = cpu_name(lscpu())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))  # children inherit it: a socket per stream, twice
    rates: dict[float, int] = {}
    for streams, rate in steps:
        rates[rate] = max(rates.get(rate, 0), int(streams * 1.1) + 16)
    profiled = max((s for s in steps if s[1] >= 20), default=None)
    rows, profiles = [], []
    for gateways in args.gateways:
        work = Path(tempfile.mkdtemp(prefix="switchyard-bench-streams-"))
        os.chmod(work, 0o755)  # Postgres runs as nobody under root and must enter it
        system, keys = start_system(work, gateways, rates, args.engine_step_ms)
        try:
            for streams, rate in steps:
                row = run_step(system, keys, streams, rate, args, args.profile and gateways == 1
                               and (streams, rate) == profiled)
                rows.append((gateways, row))
                print(f"gateways={gateways} {row}", flush=True)
                if row["profile"]:
                    profiles.append(f"Gateway profile, {streams} streams at {rate:g} tok/s, one process:\n\n```\n"
                                    f"{row['profile']}\n```")
        finally:
            system.stop()
            shutil.rmtree(work, ignore_errors=True)
    table = markdown_table(
        ("gateways", "streams", "tok/s each", "completed", "failed", "relayed tok/s", "added TTFT p50 / p99 ms",
         "added gap p99 ms", "gateway us/token", "gateway MB / 1k streams", "gateway CPU", "NATS CPU",
         "worker CPU", "client CPU"),
        [(g, r["streams"], f"{r['rate']:g}", r["ok"], r["failed"], f"{r['relayed_tok_s']:.0f}",
          f"{r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f}", f"{r['gap_p99_ms']:.0f}",
          f"{r['gateway_us_per_token']:.0f}", f"{r['gateway_mb_per_1k']:.1f}", f"{r['gateway_cpu']:.0%}",
          f"{r['nats_cpu']:.0%}", f"{r['worker_cpu']:.0%}", f"{r['client_cpu']:.0%}") for g, r in rows])
    failures = [f"- {g} gateway(s), {r['streams']} streams: {'; '.join(r['errors'])}" for g, r in rows if r["errors"]]
    text = (f"## Streams through the platform (simulated engine), {cpu}, {os.cpu_count()} cores\n\n"
            f"`{command_line()}`: a step's streams started over {args.ramp:g} s (at most {args.open_per_s:g} a "
            f"second), all open together for {args.seconds:g} s after that, {args.clients} client processes at nice "
            f"{args.client_nice}; the simulated engine steps every {args.engine_step_ms:g} ms (so up to that much of a "
            "gap is the engine's); client, gateway(s), NATS and worker on the same cores. CPU columns: share of one "
            "core over the step.\n\n" + table + "\n"
            + ("\nFailures:\n" + "\n".join(failures) + "\n" if failures else "")
            + "".join(f"\n{p}\n" for p in profiles))
    print(text)
    append_section(text, args.results)


if __name__ == "__main__":
    main()
