"""Fair share within a tier: in `free`, tenant H sends ten times tenant L's load, beyond what the worker can run.
Does L's time to first token stay within 3x of its value alone, and is L never refused while H's requests queue?

    .venv/bin/python bench/fairness.py                     # starts its own system, ~3 minutes on 2 CPU cores
    .venv/bin/python bench/fairness.py --h-x 2 --duration 90

It starts embedded NATS + Postgres in a temp dir, one worker (SmolLM2-135M from the model cache) and one gateway,
and makes two free-tier tenants (no per-key rate limits: this measures the queues). Phases, open loop with Poisson
arrivals (bench/overload.py's client: streaming chat, ignore_eos, fixed max_tokens): (0) capacity, a burst;
(1) L alone at ``--l-rate`` x capacity; (2) H at ``--h-x`` x capacity (an overload: its queue fills to its tenant
cap and the rest is refused) with L at the same rate as alone, for ``--duration`` s. Prints ``lscpu`` and appends
the table to bench/RESULTS.md. Targets: L's TTFT p95 mixed <= 3x alone; L's 429s = 0.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import shutil
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, local_system, lscpu, unlimited_keys  # noqa: E402
from bench.overload import MODEL, drain, ms, one, poisson, summarize  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support.system import free_port  # noqa: E402

TIER = "free"


async def run(args, keys: dict[str, str]) -> dict:
    limits = httpx.Limits(max_connections=2000, max_keepalive_connections=200, keepalive_expiry=2.0)
    timeout = httpx.Timeout(args.max_wait + 120, connect=10)
    clients = {name: httpx.AsyncClient(base_url=args.base_url, limits=limits, timeout=timeout,
                                       headers={"Authorization": f"Bearer {key}"}) for name, key in keys.items()}
    results: list = []
    try:
        warm = [asyncio.create_task(one(clients["L"], TIER, "warmup", args, random.Random(0), results))
                for _ in range(2)]
        await drain(warm, 120)
        t0 = time.perf_counter()
        burst = [asyncio.create_task(one(clients["H"], TIER, "capacity", args, random.Random(1), results))
                 for _ in range(2 * args.max_num_seqs)]
        await drain(burst, 300)
        done = sum(1 for r in results if r.phase == "capacity" and r.outcome == "completed")
        capacity = done / (time.perf_counter() - t0)
        l_rate, h_rate = args.l_rate * capacity, args.h_x * capacity
        print(f"capacity {capacity:.2f} req/s; L alone at {l_rate:.2f} req/s", flush=True)
        alone = await poisson(clients["L"], TIER, "alone", l_rate, args.duration, 10_000, args.seed, args, results)
        await drain(alone, 120)
        print(f"mixed: H at {h_rate:.2f} req/s + L at {l_rate:.2f} req/s for {args.duration:.0f} s", flush=True)
        gens = await asyncio.gather(
            poisson(clients["H"], TIER, "mixed-H", h_rate, args.duration, 100_000, args.seed + 1, args, results),
            poisson(clients["L"], TIER, "mixed-L", l_rate, args.duration, 10_000, args.seed + 2, args, results))
        await drain([t for g in gens for t in g], args.max_wait + 90)
        return {"capacity": capacity, "rates": (h_rate, l_rate),
                "rows": [summarize(results, "alone", TIER), summarize(results, "mixed-L", TIER),
                         summarize(results, "mixed-H", TIER)]}
    finally:
        for client in clients.values():
            await client.aclose()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--l-rate", type=float, default=0.15, help="L's rate as a fraction of capacity")
    p.add_argument("--h-x", type=float, default=1.5, help="H's rate as a multiple of capacity (10x L's by default)")
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-queued", type=int, default=200, help="the free tier's cap")
    p.add_argument("--max-wait", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    cpu = lscpu()
    from switchyard.shared.config import GatewayConfig

    system, config, work = local_system("fairness", GatewayConfig(port=free_port(), queue_timeout_s=args.max_wait),
                                        {"max_num_seqs": args.max_num_seqs})
    try:
        system.start_servers()
        made = dict(zip(("H", "L"), asyncio.run(unlimited_keys(config.database_url, TIER, "H", "L"))))
        system.start_worker()
        system.start_gateway()
        args.base_url = system.url()
        system.wait_until_ready(MODEL, timeout_s=300)
        asyncio.run(_set_free_tier(config, args))
        out = asyncio.run(run(args, made))
        time.sleep(2)  # the usage writer is asynchronous
        out["server"] = asyncio.run(_server_times(config.database_url))
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, out, command, cpu)
    return 0


async def _server_times(database_url: str) -> dict:
    """Per tenant, from the usage rows: queue_ms (accepted -> a worker started it) and first_token_ms, p50/p95."""
    import asyncpg

    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT t.name, count(*) AS n, "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY queue_ms) AS q50, "
            "percentile_cont(0.95) WITHIN GROUP (ORDER BY queue_ms) AS q95, "
            "percentile_cont(0.5) WITHIN GROUP (ORDER BY first_token_ms) AS f50, "
            "percentile_cont(0.95) WITHIN GROUP (ORDER BY first_token_ms) AS f95 "
            "FROM requests r JOIN tenants t ON t.id = r.tenant_id WHERE t.name LIKE 'bench-%' GROUP BY 1 ORDER BY 1")
        return {r["name"].removeprefix("bench-"): {k: round(r[k]) for k in ("n", "q50", "q95", "f50", "f95")}
                for r in rows}
    finally:
        await conn.close()


async def _set_free_tier(config, args) -> None:
    """The free tier's cap and wait for this run (the tenant cap stays its default, a quarter of the tier's)."""
    import asyncpg
    import nats

    from switchyard.domain.tier_admin import change_tier

    nc = await nats.connect(config.nats_url)
    pool = await asyncpg.create_pool(config.database_url, min_size=1, max_size=1)
    try:
        await change_tier(nc.jetstream(), pool, TIER, "bench", max_queued=args.max_queued, max_wait_s=args.max_wait)
    finally:
        await pool.close()
        await nc.close()
    await asyncio.sleep(1.5)  # policy caches refresh within a second


def report(args, out: dict, command: str, cpu: str) -> None:
    alone, mixed_l, mixed_h = out["rows"]
    ratio = mixed_l["TTFT p95"] / alone["TTFT p95"] if mixed_l["TTFT p95"] and alone["TTFT p95"] else None
    model_name = cpu_name(cpu)
    cols = ("phase", "sent", "completed", "429 queue_full", "503 queue_timeout", "other err", "lost", "TTFT p50",
            "TTFT p95")
    rows = [[{"alone": "L alone", "mixed-L": "L with H", "mixed-H": "H"}[s["phase"]],
             *(ms(s[c]) if c.startswith("TTFT") else s[c] for c in cols[1:])] for s in out["rows"]]
    h_rate, l_rate = out["rates"]
    text = "\n".join([
        f"## Fair share within a tier: a 10x tenant against a light one ({datetime.date.today().isoformat()})", "",
        f"`{command}` on {model_name}, {os.cpu_count()} cores: one worker (SmolLM2-135M, max_num_seqs="
        f"{args.max_num_seqs}), free tier cap {args.max_queued} (a tenant: a quarter of it), streaming chat, "
        f"max_tokens={args.max_tokens}, Poisson arrivals. Capacity {out['capacity']:.2f} req/s; H {h_rate:.2f} "
        f"req/s, L {l_rate:.2f} req/s, {args.duration:.0f} s a phase.", "",
        markdown_table([c + (" ms" if c.startswith("TTFT") else "") for c in cols], rows), "",
        f"- L's TTFT p95 with H / alone = {ratio:.2f}x (target <= 3x): {'MET' if ratio and ratio <= 3 else 'NOT MET'}"
        if ratio else "- L's TTFT ratio: n/a",
        f"- L refused while H queued: {mixed_l['429 queue_full']} (target 0); H refused: {mixed_h['429 queue_full']}",
        f"- worker-side, from the usage rows (all phases; ms from the gateway's accept): {out.get('server')}",
    ]) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
