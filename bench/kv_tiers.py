"""KV tiers below the pool: conversations whose working set is ten times the worker's KV pool, tiers off vs on.

    .venv/bin/python bench/kv_tiers.py                 # starts its own system; ~15 minutes on 2 CPU cores
    .venv/bin/python bench/kv_tiers.py --conversations 8 --turns 3   # a quick look

(a) One worker (SmolLM2-135M, our engine) whose pool is the engine's smallest (one full context: 8,208 tokens),
``--conversations`` conversations of ``--turns`` turns, each opening with a history of about 1,500 tokens of its own
(nothing shared between conversations) and growing by a user message and a reply per turn: by the last turn the
working set is about ten times the pool. The turns go round-robin, one request at a time (turn 1 of every
conversation, then turn 2 of every one, ...), so by the time a conversation comes back its blocks have left the
pool. Tiers off, a returning turn prefills its whole history again; on (a host tier of ``--offload-gib``), it
loads it. Reported: TTFT p50/p90 of the returning turns, the prompt tokens they computed, and the share served from
cache. Target: returning turns' TTFT p50 at least 5x lower with the tiers.

Prints ``lscpu`` and appends the table to bench/RESULTS.md.
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
from bench.affinity import WORDS, turn  # noqa: E402
from bench.local import cpu_name, local_system, lscpu, unlimited_keys  # noqa: E402
from bench.overload import MODEL, ms, pct  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support.system import free_port  # noqa: E402


def opening(n: int, words: int) -> str:
    rng = random.Random(n)
    return f"Record {n}. " + " ".join(rng.choice(WORDS) for _ in range(words))


async def round_robin(base_url: str, key: str, args) -> list[list[dict]]:
    """Every conversation's turns, the turns sent one at a time: turn t of each conversation before turn t+1."""
    histories = [[{"role": "system", "content": opening(n, args.history_words)}] for n in range(args.conversations)]
    results: list[list[dict]] = [[] for _ in range(args.conversations)]
    rng = random.Random(7)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers={"Authorization": f"Bearer {key}"}) as http:
        for t in range(args.turns):
            for n, messages in enumerate(histories):
                question = " ".join(rng.choice(WORDS) for _ in range(args.message_words))
                messages.append({"role": "user", "content": f"Turn {t}: {question}"})
                result = await turn(http, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": result["text"]})
                results[n].append(result)
            print(f"  turn {t + 1}: done", flush=True)
    return results


def summarize(runs: list[list[dict]]) -> dict:
    returning = [t for conv in runs for t in conv[1:]]
    ttfts = [t["ttft"] for t in returning if t["ttft"] is not None]
    prompt = sum(t["prompt"] for t in returning)
    cached = sum(t["cached"] for t in returning)
    return {"p50": pct(ttfts, 50), "p90": pct(ttfts, 90), "first_p50": pct([c[0]["ttft"] for c in runs], 50),
            "computed": prompt - cached, "prompt": prompt, "share": cached / prompt if prompt else 0.0,
            "last_prompt": max(c[-1]["prompt"] for c in runs), "working_set": sum(c[-1]["prompt"] for c in runs)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=40)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--history-words", type=int, default=1250, help="the opening history (~1.2 tokens a word)")
    p.add_argument("--message-words", type=int, default=50, help="each turn's user message (~60 tokens)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--offload-gib", type=float, default=4.0)
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    cpu = lscpu()
    from switchyard.shared.config import GatewayConfig

    port = free_port()
    # The smallest pool the engine makes (one full context) and no more: kv_cache_gib below it is raised to it.
    base = {"max_num_seqs": 4, "kv_cache_gib": 0.001}
    system, config, work = local_system("kv-tiers", GatewayConfig(port=port), base)
    results = {}
    try:
        system.start_servers()
        (api_key,) = asyncio.run(unlimited_keys(config.database_url, "pro", "kv-tiers"))
        system.start_gateway("gateway", port=port)
        for mode, settings in (("off", {}), ("on", {"kv_offload_gib": args.offload_gib})):
            worker = system.start_worker(f"worker-{mode}", **settings)
            system.wait_until_ready(MODEL, timeout_s=300, port=port)
            print(f"tiers {mode}:", flush=True)
            t0 = time.perf_counter()
            runs = asyncio.run(round_robin(system.url(port), api_key, args))
            results[mode] = {**summarize(runs), "wall": time.perf_counter() - t0}
            print(f"tiers {mode}: {results[mode]}", flush=True)
            worker.stop()
            system.services.remove(worker)
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, results, command, cpu)
    return 0


def report(args, results: dict, command: str, cpu: str) -> None:
    rows = [[mode, ms(r["first_p50"]), ms(r["p50"]), ms(r["p90"]), r["computed"], f"{r['share'] * 100:.1f}%",
             f"{r['wall']:.0f}"] for mode, r in results.items()]
    off, on = results["off"], results["on"]
    speedup = off["p50"] / on["p50"] if on["p50"] else float("nan")
    text = "\n".join([
        f"## KV tiers (a): a working set ten times the pool, tiers off vs on ({datetime.date.today().isoformat()})",
        "",
        f"`{command}` on {cpu_name(cpu)}, {os.cpu_count()} cores: one worker (SmolLM2-135M, our engine, the "
        f"smallest pool: one full context of 8,208 tokens), {args.conversations} conversations x {args.turns} turns "
        f"round-robin, one request at a time; histories of {off['last_prompt']} tokens at the last turn, a working "
        f"set of {off['working_set']} tokens ({off['working_set'] / 8208:.1f}x the pool); max_tokens="
        f"{args.max_tokens}; tiers on: a host tier of {args.offload_gib} GiB (tmpfs).", "",
        markdown_table(["tiers", "turn-1 TTFT p50 ms", "returning TTFT p50 ms", "returning TTFT p90 ms",
                        "returning prompt tokens computed", "returning prompt tokens from cache", "wall s"], rows),
        "",
        f"- returning turns' TTFT p50 {speedup:.1f}x lower with the tiers (target >= 5x): "
        f"{'MET' if speedup >= 5 else 'NOT MET'}",
    ]) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
