"""KV tiers below the pool: (a) a working set ten times the worker's KV pool, (c) a worker killed mid-stream.

    .venv/bin/python bench/kv_tiers.py                 # part (a); starts its own system; ~15 minutes on 2 CPU cores
    .venv/bin/python bench/kv_tiers.py --conversations 8 --turns 3   # a quick look
    .venv/bin/python bench/kv_tiers.py --part c        # part (c); ~4 minutes on 2 CPU cores

(a) One worker (SmolLM2-135M, our engine) whose pool is the engine's smallest (one full context: 8,208 tokens),
``--conversations`` conversations of ``--turns`` turns, each opening with a history of about 1,500 tokens of its own
(nothing shared between conversations) and growing by a user message and a reply per turn: by the last turn the
working set is about ten times the pool. The turns go round-robin, one request at a time (turn 1 of every
conversation, then turn 2 of every one, ...), so by the time a conversation comes back its blocks have left the
pool. Tiers off, a returning turn prefills its whole history again; on (a host tier of ``--offload-gib``), it
loads it. Reported: TTFT p50/p90 of the returning turns, the prompt tokens they computed, and the share served from
cache. Target: returning turns' TTFT p50 at least 5x lower with the tiers.

(c) Two workers of SmolLM2 on one host, sharing the system's host tier (on) or with none (off). A streamed completion
of a ``--history-words`` prompt (about 1,500 tokens) starts on one of them; after ``--kill-after`` tokens reached
the client, the worker running it is killed (SIGKILL), and the gateway continues the stream on the other one::

    kill ──(the gateway hears no ping for 3 s)──▶ continuation published ──▶ the survivor pulls it, prefills the
    prompt and the streamed tokens (off) or loads their blocks from the host tier (on) ──▶ next token at the client

Measured at the client, ``--repetitions`` times per mode (a new prompt each time, the killed worker replaced after
each): the time from the kill to the next token, split at the continuation's publication (seen on NATS), and the
continuation's cached tokens. Target: the next token at least 3x sooner with the shared tier.

Prints ``lscpu`` and appends the table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import httpx
import nats

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
    p.add_argument("--part", choices=("a", "c"), default="a",
                   help="a: a working set ten times the pool; c: a worker killed mid-stream")
    p.add_argument("--conversations", type=int, default=40, help="(a)")
    p.add_argument("--turns", type=int, default=4, help="(a)")
    p.add_argument("--history-words", type=int, default=1250,
                   help="(a) the opening history, (c) the prompt (~1.2 tokens a word)")
    p.add_argument("--message-words", type=int, default=50, help="(a) each turn's user message (~60 tokens)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--kill-after", type=int, default=16, help="(c) tokens the client gets before the kill")
    p.add_argument("--repetitions", type=int, default=5, help="(c) killed streams per mode")
    # A tenant's blocks take at most half a tier (kv_offload_tenant_share): 8 GiB leaves this one-tenant working set
    # (3.4 GB in float32) room; 4 GiB does not, and LRU over a round-robin larger than the cache keeps nothing.
    p.add_argument("--offload-gib", type=float, default=8.0)
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    if args.part == "c" and args.max_tokens <= args.kill_after:
        p.error("--max-tokens must leave tokens after --kill-after")
    command = command_line()
    cpu = lscpu()
    return part_a(args, command, cpu) if args.part == "a" else part_c(args, command, cpu)


def part_a(args, command: str, cpu: str) -> int:
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
    report_a(args, results, command, cpu)
    return 0


def report_a(args, results: dict, command: str, cpu: str) -> None:
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


# -- (c) a worker killed mid-stream -------------------------------------------------------------------------------
def part_c(args, command: str, cpu: str) -> int:
    from switchyard.shared.config import GatewayConfig

    port = free_port()
    # A pool of one full context and no more (kv_cache_gib below it is raised to it): two workers side by side.
    base = {"max_num_seqs": 4, "kv_cache_gib": 0.001}
    system, config, work = local_system("kv-tiers-c", GatewayConfig(port=port), base)
    results: dict[str, list[dict]] = {}
    try:
        system.start_servers()
        (api_key,) = asyncio.run(unlimited_keys(config.database_url, "pro", "kv-tiers-c"))
        system.start_gateway("gateway", port=port)
        for mode, settings in (("off", {}), ("on", {"kv_offload_gib": args.offload_gib})):
            print(f"tiers {mode}:", flush=True)
            workers = [system.start_worker(f"worker-{mode}-{i}", **settings) for i in range(2)]
            results[mode] = []
            for rep in range(args.repetitions):
                system.wait_until_ready(MODEL, timeout_s=300, port=port)
                prompt = opening(10_000 * (mode == "on") + rep, args.history_words)  # a prompt no worker has seen
                run = asyncio.run(killed_stream(system.url(port), config.nats_url, api_key, prompt, workers, args))
                results[mode].append(run)
                print(f"  {rep + 1}: {json.dumps({k: v for k, v in run.items() if k != 'worker'})}", flush=True)
                # The killed worker's place is taken by a new one, started once the stream is done so that it
                # takes no CPU from the continuation.
                (dead,) = [w for w in workers if w.pid == run["worker"]]
                dead.stop()
                system.services.remove(dead)
                workers.remove(dead)
                workers.append(system.start_worker(f"worker-{mode}-{2 + rep}", **settings))
            for worker in workers:
                worker.stop()
                system.services.remove(worker)
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    report_c(args, results, command, cpu)
    return 0


async def killed_stream(base_url: str, nats_url: str, key: str, prompt: str, workers: list, args) -> dict:
    """One streamed completion whose worker is killed after ``--kill-after`` tokens; times at the client, in s."""
    from switchyard.shared import subjects
    from switchyard.shared.jetstream import live_workers
    from switchyard.shared.messages import TokenDelta, decode, decode_routed

    nc = await nats.connect(nats_url)
    request_id: str | None = None
    worker_of: dict[str, str] = {}  # request id -> the worker of its latest delta
    resumed_at: float | None = None

    async def on_delta(msg) -> None:
        for routed in decode_routed(msg.data):
            worker_of[routed.request_id] = decode(routed.delta, TokenDelta).worker_id or ""

    async def on_request(msg) -> None:
        nonlocal resumed_at
        if request_id and (msg.headers or {}).get("Nats-Msg-Id", "") == f"{request_id}.resume1":
            resumed_at = resumed_at or time.perf_counter()

    try:
        js = nc.jetstream()
        pids = {w.pid for w in workers}
        while len(live := {w.worker_id: w.pid for w in await live_workers(js)
                           if w.model == MODEL and w.pid in pids}) < 2:
            await asyncio.sleep(0.2)  # both workers in the registry (the killed one's entry may linger meanwhile)
        await nc.subscribe(subjects.gateway_token_subject("*"), cb=on_delta)
        await nc.subscribe(f"{subjects.REQUEST_PREFIX}.>", cb=on_request)
        body = {"model": MODEL, "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        tokens, killed_at, next_at, victim, usage, error = 0, None, None, None, None, None
        async with httpx.AsyncClient(timeout=600, headers={"Authorization": f"Bearer {key}"}) as http:
            async with http.stream("POST", f"{base_url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
                request_id = r.headers["X-Request-Id"]
                async for line in r.aiter_lines():
                    if not line.startswith("data: {"):
                        continue
                    obj = json.loads(line[6:])
                    error = obj.get("error") or error
                    usage = obj.get("usage") or usage
                    if not obj.get("choices"):
                        continue
                    now = time.perf_counter()
                    if resumed_at is not None and next_at is None:
                        next_at = now  # the continuation's first chunk (the dead worker's last ones came before)
                    tokens += 1
                    if tokens == args.kill_after:
                        victim = live[worker_of[request_id]]
                        os.kill(victim, signal.SIGKILL)
                        killed_at = time.perf_counter()
    finally:
        await nc.close()
    if error or killed_at is None or resumed_at is None or next_at is None or usage is None:
        raise RuntimeError(f"the stream was not continued: error {error}, killed {killed_at}, "
                           f"resumed {resumed_at}, next token {next_at}")
    return {"kill_to_next": next_at - killed_at, "kill_to_published": resumed_at - killed_at,
            "published_to_next": next_at - resumed_at, "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": usage["prompt_tokens_details"]["cached_tokens"],
            "completion_tokens": usage["completion_tokens"], "worker": victim}


def report_c(args, results: dict[str, list[dict]], command: str, cpu: str) -> None:
    def p50(runs: list[dict], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    rows = [[mode, len(runs), ms(p50(runs, "kill_to_next")),
             f"{ms(min(r['kill_to_next'] for r in runs))}-{ms(max(r['kill_to_next'] for r in runs))}",
             ms(p50(runs, "kill_to_published")), ms(p50(runs, "published_to_next")),
             f"{int(p50(runs, 'cached_tokens'))} of {int(p50(runs, 'prompt_tokens'))}"]
            for mode, runs in results.items()]
    off, on = results["off"], results["on"]
    total = p50(off, "kill_to_next") / p50(on, "kill_to_next")
    continuation = p50(off, "published_to_next") / p50(on, "published_to_next")
    text = "\n".join([
        f"## KV tiers (c): a worker killed mid-stream, its continuation with the shared host tier vs recompute "
        f"({datetime.date.today().isoformat()})",
        "",
        f"`{command}` on {cpu_name(cpu)}, {os.cpu_count()} cores: two workers (SmolLM2-135M, our engine, a pool of "
        f"one full context each) on one host; a streamed completion of a {int(p50(off, 'prompt_tokens'))}-token "
        f"prompt (median), max_tokens={args.max_tokens}, its worker SIGKILLed after {args.kill_after} tokens reached "
        f"the client, the stream continued by the gateway on the other worker; {args.repetitions} streams per mode, "
        f"a new prompt each, the killed worker replaced after each; tiers on: both workers on the system's host "
        f"tier of {args.offload_gib} GiB (tmpfs). Times at the client; the continuation's publication is seen on "
        f"NATS.", "",
        markdown_table(["tiers", "streams", "kill to next token p50 ms", "min-max ms",
                        "kill to continuation published p50 ms", "published to next token p50 ms",
                        "continuation's cached tokens (p50)"], rows),
        "",
        f"- kill to next token {total:.1f}x sooner with the shared tier (target >= 3x): "
        f"{'MET' if total >= 3 else 'NOT MET'}",
        f"- the continuation alone (published to next token: the survivor pulls it, then prefills or loads) "
        f"{continuation:.1f}x sooner; the gateway's wait before it continues a stream (no ping from the worker for "
        f"3 s, checked each second) is the same in both modes",
    ]) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
