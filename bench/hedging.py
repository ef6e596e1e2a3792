"""Hedged requests against a stalled worker: what does a worker that stops for 2 s out of every 5 (SIGSTOP, then
SIGCONT: a long GC, a noisy neighbour, a throttled host) cost enterprise TTFT, with hedging off and on?

    .venv/bin/python bench/hedging.py                      # 3 workers, 60 s a phase, 8 requests/s
    .venv/bin/python bench/hedging.py --seconds 30 --rate 6 --hedge-after-ms 300

Three simulated workers (workers/simulated_engine.py, a test double: the model's speed does not matter here, the
placement does) of ``--seats`` seats, each prompt prefilled in ``--prefill-ms`` and answered with ``--tokens``
tokens at ``--token-rate`` tokens/s. Enterprise streams arrive at ``--rate`` a second (Poisson, open loop: a
stalled worker does not slow the arrivals), far under the fleet's seats, so a hedge has somewhere to go. Phases, on
one system:

1. healthy: no stall, hedging off: the reference TTFT;
2. stalled: worker 0 stopped 2 s in every 5, hedging off;
3. stalled, hedged: as 2, the enterprise tier hedged after ``--hedge-after-ms`` (default ``auto``: the tier's
   recent TTFT p95, which phases 1 and 2 taught the gateway) with its default budget (5% of its requests).

Reported per phase: TTFT p50/p99/max at the client, the requests whose TTFT passed 1 s, hedges started and won
(the gateway's counters), and the tokens the losers computed for nothing (the workers'
``switchyard:worker_dismissed_tokens_total``) against the tokens billed. Target (issue 41): hedged p99 within
1.5x the healthy p99, at most 5% extra tokens. ``lscpu`` is printed and the CPU named with the table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, lscpu  # noqa: E402
from bench.overload import ms, pct  # noqa: E402
from bench.results import append_section, command_line, markdown_table  # noqa: E402

ADMIN_KEY = "bench-hedging-admin"
MODEL = "sim"
TIER = "enterprise"
STALL_S, EVERY_S = 2.0, 5.0
PROMPT_TOKENS = 100  # the simulated engine counts 4 bytes a token


def start_system(work: Path, args) -> tuple[object, list]:
    from switchyard.deploy.system import LocalSystem
    from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
    from tests.support.system import free_port

    config = SwitchyardConfig(data_dir=work, gateway=GatewayConfig(port=free_port(), admin_key=ADMIN_KEY,
                                                                    affinity=False),
                              worker=WorkerConfig(engine="simulated"))
    system = LocalSystem(config, log_dir=work, log_level="WARNING", ephemeral=True)
    system.start_servers()
    workers = [system.start_worker(f"worker-{i}", model=MODEL, max_num_seqs=args.seats,
                                   simulated_tokens_per_s=args.token_rate, metrics_port=free_port(),
                                   simulated_prefill_us_per_token=args.prefill_ms * 1000 / PROMPT_TOKENS)
               for i in range(3)]
    system.start_gateway()
    system.wait_until_ready(MODEL, timeout_s=120)
    return system, workers


class Staller:
    """Stops one process for ``STALL_S`` in every ``EVERY_S`` while running."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(EVERY_S - STALL_S):
            os.kill(self.pid, signal.SIGSTOP)
            self._stop.wait(STALL_S)
            os.kill(self.pid, signal.SIGCONT)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        os.kill(self.pid, signal.SIGCONT)


async def stream(http, url: str, key: str, tokens: int) -> tuple[float, int] | None:
    """One enterprise stream: (TTFT in s, tokens billed), or None if it failed."""
    body = {"model": MODEL, "prompt": "x" * (PROMPT_TOKENS * 4 - 4), "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, billed = None, 0
    try:
        async with http.stream("POST", f"{url}/v1/completions", json=body,
                               headers={"Authorization": f"Bearer {key}"}) as r:
            if r.status_code != 200:
                return None
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return None
                if ttft is None and event["choices"] and event["choices"][0]["text"]:
                    ttft = time.perf_counter() - t0
                if event.get("usage"):
                    billed = event["usage"]["total_tokens"]
    except Exception:
        return None
    return (ttft, billed) if ttft is not None else None


async def load(url: str, key: str, seconds: float, rate: float, tokens: int) -> tuple[list[float], int, int]:
    """Open-loop Poisson arrivals for ``seconds``: (TTFTs, tokens billed, failures)."""
    import httpx

    results: list[asyncio.Task] = []
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=1000)) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            results.append(asyncio.create_task(stream(http, url, key, tokens)))
            await asyncio.sleep(random.expovariate(rate))
        done = await asyncio.gather(*results)
    ok = [d for d in done if d is not None]
    return [t for t, _ in ok], sum(b for _, b in ok), len(done) - len(ok)


def counters(text: str, metric: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(metric + "{") and all(w in line for w in want))


async def scrape(system, worker_urls: list[str]) -> tuple[float, float, float]:
    """(hedges started, hedges won, tokens dismissed) so far."""
    import httpx

    async with httpx.AsyncClient(timeout=10) as http:
        gateway = (await http.get(f"{system.url()}/metrics")).text
        dismissed = 0.0
        for url in worker_urls:
            dismissed += counters((await http.get(url)).text, "switchyard:worker_dismissed_tokens_total")
    return (counters(gateway, "switchyard:hedges_started_total", tier=TIER),
            counters(gateway, "switchyard:hedges_won_total", tier=TIER), dismissed)


async def set_hedging(url: str, after: str) -> None:
    import httpx

    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.put(f"{url}/admin/tiers/{TIER}", headers={"Authorization": f"Bearer {ADMIN_KEY}"},
                           json={"hedge_after_ms": after})
        r.raise_for_status()


async def run(args, system, workers: list, report: str) -> None:
    from bench.local import unlimited_keys
    from switchyard.shared.jetstream import live_workers

    (key,) = await unlimited_keys(system.config.database_url, TIER, "hedging")
    import nats

    nc = await nats.connect(system.config.nats_url)
    infos = [w for w in await live_workers(nc.jetstream()) if w.model == MODEL]
    await nc.close()
    stalled_pid = workers[0].pid
    urls = [w.metrics_url for w in infos]
    rows = []
    for phase, stall, hedge in (("healthy", False, "off"), ("stalled, no hedging", True, "off"),
                                (f"stalled, hedged after {args.hedge_after_ms}", True, args.hedge_after_ms)):
        await set_hedging(system.url(), hedge)
        await asyncio.sleep(1.5)  # every gateway cache has the policy
        before = await scrape(system, urls)
        staller = Staller(stalled_pid) if stall else None
        try:
            ttfts, billed, failed = await load(system.url(), key, args.seconds, args.rate, args.tokens)
        finally:
            if staller is not None:
                staller.stop()
        await asyncio.sleep(2)  # the losers hear they lost and count it
        after = await scrape(system, urls)
        started, won, dismissed = (a - b for a, b in zip(after, before))
        rows.append((phase, len(ttfts), failed, ms(pct(ttfts, 50)), ms(pct(ttfts, 99)),
                     ms(max(ttfts, default=None)), sum(t > 1.0 for t in ttfts), f"{started:.0f}",
                     f"{won:.0f}", f"{dismissed:.0f}", f"{100 * dismissed / max(1, billed):.1f}%"))
        print(rows[-1], flush=True)
    healthy_p99, hedged_p99 = float(rows[0][4]), float(rows[2][4])
    table = markdown_table(("phase", "requests", "failed", "TTFT p50 ms", "TTFT p99 ms", "TTFT max ms",
                            "TTFT over 1 s", "hedges started", "hedges won", "tokens dismissed", "extra tokens"), rows)
    section = (f"## Hedged requests against a stalled worker ({time.strftime('%Y-%m-%d')}, {cpu_name(report)}, "
               f"{os.cpu_count()} cores)\n\n`{command_line()}`\n\n3 simulated workers, {args.seats} seats "
               f"each, prefill {args.prefill_ms:g} ms, {args.tokens} tokens at {args.token_rate:g}/s; "
               f"enterprise streams at {args.rate:g}/s; worker 0 stopped {STALL_S:g} s in every {EVERY_S:g} s "
               f"in the stalled phases.\n\n{table}\n\nHedged p99 / healthy p99: "
               f"{hedged_p99 / max(1.0, healthy_p99):.2f}x (target at most 1.5x).\n")
    print(section)
    append_section(section, args.results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=8.0, help="enterprise streams a second")
    parser.add_argument("--seats", type=int, default=16)
    parser.add_argument("--prefill-ms", type=float, default=200.0)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--token-rate", type=float, default=50.0)
    parser.add_argument("--hedge-after-ms", default="auto")
    parser.add_argument("--results", default=None, help="where to append the section ('-': nowhere)")
    args = parser.parse_args()
    if args.results is None:
        from bench.results import RESULTS

        args.results = RESULTS
    report = lscpu()
    work = Path(tempfile.mkdtemp(prefix="switchyard-bench-hedging-"))
    os.chmod(work, 0o755)
    system, workers = start_system(work, args)
    try:
        asyncio.run(run(args, system, workers, report))
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
