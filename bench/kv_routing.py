"""KV-aware routing: two workers on one host, placement by the affinity record vs by the fleet's KV index.

    .venv/bin/python bench/kv_routing.py                 # starts its own system; ~12 minutes on 2 CPU cores
    .venv/bin/python bench/kv_routing.py --conversations 6 --turns 2   # a quick look

(b) of issue 38. Two workers of SmolLM2-135M (our engine, one torch thread each) share a host KV tier; a gateway
places chat requests by ``gateway.placement`` = ``affinity`` (the worker that served a conversation's last turn,
or the last to serve a long system prompt) or ``kv_index`` (what each worker's pool and the node's tiers hold, from
the workers' KV events, against their load). Two workloads, ``--concurrency`` conversations at a time:

- ``histories``: conversations with histories of their own (~``--history-words`` words each), ``--turns`` turns.
- ``shared-prefix``: conversations that all open with one long system prompt (~``--history-words`` words) and
  differ in their short user messages.
- ``shared-prefix-burst``: once one conversation on that system prompt has run, ``--burst`` new ones open at the
  same moment (a popular application's traffic): one turn each, all at once.

Reported per mode and workload: TTFT p50/p90 of every request, and the share of prompt tokens served from cache
(the usage's cached_tokens). Target: the index at least matches affinity's hit rate, and beats it on the
shared-prefix workload. Prints ``lscpu`` and appends the table to bench/RESULTS.md.
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

WORKLOADS = ("histories", "shared-prefix", "shared-prefix-burst")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def opening(workload: str, n: int, args) -> str:
    if workload.startswith("shared-prefix"):
        return "You are the archivist of this record: " + words(random.Random(0), args.history_words)
    return f"Record {n}: " + words(random.Random(1000 + n), args.history_words)


async def run(base_url: str, key: str, workload: str, args, seed: int) -> list[dict]:
    rng = random.Random(seed)
    if workload == "shared-prefix-burst":
        return await burst(base_url, key, args, rng)
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=900, headers={"Authorization": f"Bearer {key}"}) as http:
        async def conversation(n: int) -> list[dict]:
            async with gate:
                messages = [{"role": "system", "content": opening(workload, n, args)}]
                turns = []
                for t in range(args.turns):
                    messages.append({"role": "user", "content": f"Entry {n}.{t}: {words(rng, args.message_words)}"})
                    result = await turn(http, messages, args.max_tokens)
                    messages.append({"role": "assistant", "content": result["text"]})
                    turns.append(result)
                return turns

        runs = await asyncio.gather(*(conversation(n) for n in range(args.conversations)))
    return [t for conv in runs for t in conv]


async def burst(base_url: str, key: str, args, rng: random.Random) -> list[dict]:
    """One conversation on the shared system prompt, then ``--burst`` new ones at once; the burst's turns."""
    system = {"role": "system", "content": opening("shared-prefix-burst", 0, args)}
    async with httpx.AsyncClient(base_url=base_url, timeout=900, headers={"Authorization": f"Bearer {key}"}) as http:
        await turn(http, [system, {"role": "user", "content": words(rng, args.message_words)}], args.max_tokens)
        questions = [f"Question {n}: {words(rng, args.message_words)}" for n in range(args.burst)]
        return list(await asyncio.gather(*(turn(http, [system, {"role": "user", "content": q}], args.max_tokens)
                                           for q in questions)))


def summarize(turns: list[dict], wall: float) -> dict:
    ttfts = [t["ttft"] for t in turns if t["ttft"] is not None]
    prompt = sum(t["prompt"] for t in turns)
    return {"p50": pct(ttfts, 50), "p90": pct(ttfts, 90), "hit": sum(t["cached"] for t in turns) / prompt,
            "requests": len(turns), "wall": wall}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--conversations", type=int, default=12)
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--turns", type=int, default=3)
    p.add_argument("--history-words", type=int, default=600, help="~1.2 tokens a word")
    p.add_argument("--message-words", type=int, default=30)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--burst", type=int, default=16, help="shared-prefix-burst: new conversations at once")
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    cpu = lscpu()
    from switchyard.shared.config import GatewayConfig

    settings = {"torch_threads": 1, "max_num_seqs": 4, "kv_offload_gib": 2.0}
    system, config, work = local_system("kv-routing", GatewayConfig(port=free_port()), settings)
    results: dict[tuple[str, str], dict] = {}
    try:
        system.start_servers()
        (api_key,) = asyncio.run(unlimited_keys(config.database_url, "pro", "kv-routing"))
        for placement in ("affinity", "kv_index"):
            # Fresh workers and an empty host tier for each mode: neither starts with the other's cache.
            workers = [system.start_worker(f"worker-{placement}-{i}") for i in range(2)]
            port = free_port()
            gateway = system.start_gateway(f"gateway-{placement}", port=port, placement=placement)
            system.wait_until_ready(MODEL, timeout_s=300, port=port)
            for workload in WORKLOADS:
                t0 = time.perf_counter()
                turns = asyncio.run(run(system.url(port), api_key, workload, args, seed=7))  # the same traffic
                results[(placement, workload)] = summarize(turns, time.perf_counter() - t0)
                print(f"{placement} {workload}: {results[(placement, workload)]}", flush=True)
            for service in (gateway, *workers):
                service.stop()
                system.services.remove(service)
            shutil.rmtree(system._host_tier_dir(), ignore_errors=True)
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, results, command, cpu)
    return 0


def report(args, results: dict, command: str, cpu: str) -> None:
    rows = [[placement, workload, ms(r["p50"]), ms(r["p90"]), f"{r['hit'] * 100:.1f}%", r["requests"],
             f"{r['wall']:.0f}"] for (placement, workload), r in results.items()]
    verdicts = []
    for workload in WORKLOADS:
        aff, idx = results[("affinity", workload)], results[("kv_index", workload)]
        verdicts.append(f"- {workload}: hit rate {idx['hit'] * 100:.1f}% by the index vs {aff['hit'] * 100:.1f}% by "
                        f"affinity, TTFT p50 {ms(idx['p50'])} vs {ms(aff['p50'])} ms")
    hist_aff, hist_idx = results[("affinity", "histories")], results[("kv_index", "histories")]
    matches = hist_idx["hit"] >= hist_aff["hit"] - 0.01

    def beats(workload: str) -> str:
        aff, idx = results[("affinity", workload)], results[("kv_index", workload)]
        return "MET" if idx["p50"] < aff["p50"] and idx["hit"] >= aff["hit"] - 0.01 else "NOT MET"

    text = "\n".join([
        f"## KV tiers (b): routing by affinity vs by the KV index, two workers ({datetime.date.today().isoformat()})",
        "",
        f"`{command}` on {cpu_name(cpu)}, {os.cpu_count()} cores: two workers (SmolLM2-135M, our engine, one torch "
        f"thread each, 4 seats, a shared host tier of 2 GiB), {args.conversations} conversations of {args.turns} "
        f"turns, {args.concurrency} at a time, openings of ~{args.history_words} words, messages of "
        f"{args.message_words} words, max_tokens={args.max_tokens}; the burst: {args.burst} new conversations at "
        f"once on the shared system prompt, after one.", "",
        markdown_table(["placement", "workload", "TTFT p50 ms", "TTFT p90 ms", "prompt tokens from cache",
                        "requests", "wall s"], rows), "",
        *verdicts,
        f"- the index matches affinity's hit rate on histories: {'MET' if matches else 'NOT MET'}; beats it on "
        f"shared-prefix traffic (a hit rate as high, a lower TTFT p50): {beats('shared-prefix')} for conversations "
        f"{args.concurrency} at a time, {beats('shared-prefix-burst')} for the burst",
    ]) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
