"""A tenant whose prompts are slow to prepare, and what it costs another tenant on the same worker: the victim's
time to first token idle and under attack, in pairs close in time (tests/support/slow_prompts.py).

    .venv/bin/python bench/hostile.py                          # both attacks, 24 pairs each, ~6 min on 2 cores
    .venv/bin/python bench/hostile.py --attack "2048 messages" --pairs 48

It starts its own system in a temp dir: embedded NATS and Postgres, one worker of the tiny random test model
(``--max-num-seqs`` 4, fp32), the victim's gateway, and the attacker's gateway of its own that lets schemas up to
4 MB through, at a lower CPU priority (a gateway pays to parse what it is sent, and gateways scale out on machines
of their own; here every process shares the machine). Two tenants on the pro tier, no rate limits.

Attacks: six loops sending 350 KB schemas (about half a second of grammar compiling each) or 2048-message chats;
with ``--oversized`` (issue 42), bodies the gateway refuses with a 400 (a 700 KB 8000-branch schema, 15,000
messages), sent to the victim's own gateway: what they cost is its event loop's time to read and refuse them.
Reported per attack: the victim's TTFT median and p90, idle and attacked, their ratio (target: attacked median
within 1.5x of idle), and how many attacked requests were served inside an attacker request's span (the mechanism
tests/e2e/test_hostile_work.py asserts). Everything is stopped by PID at the end and the temp dir removed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, local_system, lscpu, unlimited_keys  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support.slow_prompts import ATTACKS, BODIES, OVERSIZED, bearer, measure_pairs  # noqa: E402
from tests.support.system import free_port  # noqa: E402

MODEL = "tiny-fair"
TARGET = 1.5  # attacked median TTFT over idle


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


async def run(base_url: str, attacker_url: str, database_url: str, attacks: list[str], pairs: int) -> list[tuple]:
    victim_key, attacker_key = await unlimited_keys(database_url, "pro", "victim", "attacker")
    rows = []
    async with httpx.AsyncClient(base_url=base_url, headers=bearer(victim_key), timeout=120) as victim, \
            httpx.AsyncClient(base_url=attacker_url, headers=bearer(attacker_key), timeout=120) as attacker:
        for attack in attacks:
            measured = await measure_pairs(victim, attacker, MODEL, attack, pairs)
            idle = measured.idle
            attacked = [t for _, t, _ in measured.attacked]
            ratio = statistics.median(attacked) / statistics.median(idle)
            spans = [b - a for a, b in measured.attacks]
            rows.append((attack, pairs, f"{statistics.median(idle) * 1e3:.0f}", f"{p90(idle) * 1e3:.0f}",
                         f"{statistics.median(attacked) * 1e3:.0f}", f"{p90(attacked) * 1e3:.0f}",
                         f"{ratio:.2f}x", "met" if ratio <= TARGET else "**not met**",
                         f"{measured.inside()}/{pairs}", f"{statistics.median(spans):.2f}"))
            print(" | ".join(map(str, rows[-1])), flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attack", action="append", choices=list(BODIES),
                        help="default: the two slow ones (with --oversized: the two oversized ones)")
    parser.add_argument("--oversized", action="store_true",
                        help="bodies the gateway refuses (issue 42): sent to the victim's own gateway, whose event "
                             "loop is what they cost")
    parser.add_argument("--pairs", type=int, default=24)
    parser.add_argument("--max-num-seqs", type=int, default=4)
    parser.add_argument("--results", default=str(RESULTS), help="markdown file to append to; '-' for none")
    args = parser.parse_args()

    from switchyard.deploy.services import wait_until_ready
    from switchyard.shared.config import GatewayConfig
    from tests.support.tiny_model import save_tiny_model

    cpu = cpu_name(lscpu())
    system, config, work = local_system("hostile", GatewayConfig(port=free_port()),
                                        {"dtype": "float32", "max_num_seqs": args.max_num_seqs},
                                        model=lambda work: save_tiny_model(work / "tiny-model"), served_name=MODEL)
    try:
        system.start_servers()
        worker = system.start_worker()
        system.start_gateway()
        system.wait_until_ready(MODEL, timeout_s=120)
        attacker_url = system.url()
        if not args.oversized:
            attacker_port = free_port()
            limits = config.gateway.limits.model_copy(update={"max_schema_bytes": 4_000_000})
            attacker_gateway = system.start_gateway("gateway-attacker", port=attacker_port, run_jobs=False,
                                                    limits=limits, refused_body_bytes_per_minute=1 << 40)
            attacker_url = f"http://127.0.0.1:{attacker_port}"
            wait_until_ready(attacker_url, MODEL, timeout_s=120, watch=[worker, attacker_gateway])
            os.setpriority(os.PRIO_PROCESS, attacker_gateway.pid, 10)
        attacks = args.attack or list(OVERSIZED if args.oversized else ATTACKS)
        rows = asyncio.run(run(system.url(), attacker_url, config.database_url, attacks, args.pairs))
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)

    title = ("A tenant's oversized bodies on the victim's gateway" if args.oversized
             else "A tenant's slow prompts beside a victim's")
    text = (f"## {title} ({cpu}, {os.cpu_count()} cores)\n\n`{command_line()}`\n\n"
            f"Tiny model, one worker (max_num_seqs {args.max_num_seqs}), six attacking loops; the victim's streamed "
            "2-token requests, TTFT in ms, pairs close in time (idle, then under attack).\n\n"
            + markdown_table(("attack", "pairs", "idle p50", "idle p90", "attacked p50", "attacked p90",
                              "attacked / idle", f"<= {TARGET}x", "inside an attacker's request",
                              "attacker request s (median)"), rows) + "\n")
    print(text, flush=True)
    append_section(text, args.results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
