"""Prefill and decode pools against whole-request workers: do running streams keep their pace while long prompts
arrive?

    .venv/bin/python bench/disagg.py                  # starts its own system; ~8 minutes on 2 CPU cores
    .venv/bin/python bench/disagg.py --seconds 15     # a quick look

Issue 39's measurement, on one machine. SmolLM2-135M on our engine, three layouts of the same two cores:

- ``one``: one worker of whole requests on both cores (two torch threads);
- ``two``: two workers of whole requests, each pinned to a core of its own (``taskset``, one torch thread);
- ``pools``: a prefill worker on one core and a decode worker on the other, sharing a host KV tier (the nearest
  stand-in here for two machines).

Each layout runs ``--streams`` steady streams (each ``--stream-tokens`` tokens from a short prompt, started again as
it ends) for ``--seconds``, first alone, then while a long prompt (``--long-words`` words, about 2,000 tokens)
arrives every ``--every`` seconds. Reported per layout and phase: the steady streams' inter-token gap p50/p99 (the
gap between two content chunks of one stream), the long prompts' TTFT p50/p99, output tokens/s, and the KV bytes
the decode worker loaded per handed-over request. Target: with pools, the streams' ITL p99 under long prompts is at
most 1.5x their ITL p99 with none, where the whole-request layouts show the prefill stall; every long prompt's
greedy reply the same in every layout. Prints ``lscpu`` and appends the table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.affinity import WORDS  # noqa: E402
from bench.local import MODEL, cpu_name, local_system, lscpu, unlimited_keys  # noqa: E402
from bench.overload import ms, pct  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support.system import free_port  # noqa: E402

LAYOUTS = ("one", "two", "pools")


async def stream(http: httpx.AsyncClient, key: str, prompt: str, max_tokens: int) -> tuple[float, list[float], str]:
    """One streamed completion: (TTFT s, the gaps between its content chunks in s, its text)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    times, text = [], []
    async with http.stream("POST", "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            if event["choices"] and event["choices"][0]["text"]:
                times.append(time.perf_counter())
                text.append(event["choices"][0]["text"])
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], "".join(text)


async def phase(base_url: str, key: str, args, long_prompts: list[str]) -> dict:
    """The steady streams for ``args.seconds``, and ``long_prompts`` one every ``args.every`` s meanwhile."""
    gaps: list[float] = []
    ttfts: list[float] = []
    replies: list[str] = []
    tokens = 0
    end = time.perf_counter() + args.seconds
    async with httpx.AsyncClient(base_url=base_url, timeout=600) as http:
        async def steady(n: int) -> None:
            nonlocal tokens
            rng = random.Random(n)
            while time.perf_counter() < end:
                prompt = f"Stream {n}: " + " ".join(rng.choice(WORDS) for _ in range(12))
                _, stream_gaps, _ = await stream(http, key, prompt, args.stream_tokens)
                gaps.extend(stream_gaps)
                tokens += args.stream_tokens

        async def arriving() -> None:
            nonlocal tokens
            tasks = []
            for prompt in long_prompts:
                await asyncio.sleep(args.every)
                if time.perf_counter() > end:
                    break
                tasks.append(asyncio.create_task(stream(http, key, prompt, args.long_tokens)))
            for ttft, _, text in await asyncio.gather(*tasks):
                ttfts.append(ttft)
                replies.append(text)
                tokens += args.long_tokens

        t0 = time.perf_counter()
        await asyncio.gather(*(steady(n) for n in range(args.streams)), arriving())
        wall = time.perf_counter() - t0
    return {"gaps": gaps, "ttfts": ttfts, "replies": replies, "tok_s": tokens / wall}


def pin(worker, core: int) -> None:
    """Every thread of ``worker``'s process on ``core`` alone."""
    subprocess.run(["taskset", "-a", "-cp", str(core), str(worker.pid)], check=True, capture_output=True)


def start_layout(system, layout: str) -> list:
    if layout == "one":
        return [system.start_worker("worker-one", torch_threads=2)]
    roles = ("both", "both") if layout == "two" else ("prefill", "decode")
    workers = [system.start_worker(f"worker-{layout}-{i}", torch_threads=1, role=role)
               for i, role in enumerate(roles)]
    return workers


async def live(nats_url: str, count: int | None = None) -> list:
    """The model's live workers; with ``count``, once there are that many."""
    import nats

    from switchyard.shared.jetstream import live_workers

    nc = await nats.connect(nats_url)
    try:
        while True:
            workers = [w for w in await live_workers(nc.jetstream()) if w.model == MODEL]
            if count is None or len(workers) == count:
                return workers
            await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def metric(nats_url: str, name: str, **labels) -> float:
    """The sum of ``name``'s samples with ``labels`` over the model's live workers (their /metrics)."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    workers = await live(nats_url)
    async with httpx.AsyncClient(timeout=30) as http:
        for w in workers:
            text = (await http.get(w.metrics_url)).text
            total += sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
                         if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))
    return total


def block_bytes(model_dir: Path, block_size: int) -> int:
    """One KV block of the model in float32: K and V of every layer."""
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * block_size * 4


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=64)
    p.add_argument("--long-words", type=int, default=1500, help="~1.3 tokens a word: about 2,000 tokens")
    p.add_argument("--long-tokens", type=int, default=16)
    p.add_argument("--every", type=float, default=6.0, help="seconds between long prompts")
    p.add_argument("--seconds", type=float, default=40.0, help="each phase")
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    cpu = lscpu()
    from switchyard.shared.config import GatewayConfig, WorkerConfig

    rng = random.Random(3)
    long_prompts = [f"Ledger {i}: " + " ".join(rng.choice(WORDS) for _ in range(args.long_words))
                    for i in range(int(args.seconds / args.every) + 1)]
    settings = {"max_num_seqs": args.streams + 8, "kv_offload_gib": 2.0, "dtype": "float32"}
    system, config, work = local_system("disagg", GatewayConfig(port=free_port()), settings)
    results: dict[tuple[str, str], dict] = {}
    moved: dict[str, float] = {}
    try:
        system.start_servers()
        (api_key,) = asyncio.run(unlimited_keys(config.database_url, "pro", "disagg"))
        gateway = system.start_gateway()
        for layout in LAYOUTS:
            workers = start_layout(system, layout)
            system.wait_until_ready(MODEL, timeout_s=300)
            asyncio.run(asyncio.wait_for(live(config.nats_url, len(workers)), 300))
            if layout != "one":
                for core, worker in enumerate(workers):
                    pin(worker, core)
            for name, prompts in (("alone", []), ("long prompts", long_prompts)):
                results[(layout, name)] = r = asyncio.run(phase(system.url(), api_key, args, prompts))
                print(f"{layout} / {name}: ITL p99 {ms(pct(r['gaps'], 99))} ms, TTFT p50 "
                      f"{ms(pct(r['ttfts'], 50)) if r['ttfts'] else '-'} ms, {r['tok_s']:.0f} tok/s", flush=True)
            if layout == "pools":
                hits = asyncio.run(metric(config.nats_url, "switchyard:kv_tier_hits_total", kv_tier="host"))
                handovers = asyncio.run(metric(config.nats_url, "switchyard:request_success_total",
                                               finished_reason="handover"))
                dropped = asyncio.run(metric(config.nats_url, "switchyard:kv_tier_dropped_stores_total",
                                             kv_tier="host"))
                moved = {"bytes": hits * block_bytes(Path(config.worker.model), WorkerConfig().block_size)
                         / max(1.0, handovers), "handovers": handovers, "dropped": dropped}
            for worker in workers:
                worker.stop()
                system.services.remove(worker)
            shutil.rmtree(system._host_tier_dir(), ignore_errors=True)
        gateway.stop()
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, results, moved, command, cpu)
    return 0


def report(args, results: dict, moved: dict, command: str, cpu: str) -> None:
    rows = []
    for (layout, name), r in results.items():
        rows.append([layout, name, ms(pct(r["gaps"], 50)), ms(pct(r["gaps"], 99)),
                     ms(pct(r["ttfts"], 50)) if r["ttfts"] else "-", ms(pct(r["ttfts"], 99)) if r["ttfts"] else "-",
                     f"{r['tok_s']:.0f}", len(r["ttfts"])])
    verdicts = []
    for layout in LAYOUTS:
        alone, loaded = pct(results[(layout, "alone")]["gaps"], 99), pct(results[(layout, "long prompts")]["gaps"], 99)
        verdicts.append(f"- {layout}: the streams' ITL p99 {ms(loaded)} ms under long prompts vs {ms(alone)} ms "
                        f"alone ({loaded / alone:.2f}x)")
    pools = pct(results[("pools", "long prompts")]["gaps"], 99) / pct(results[("pools", "alone")]["gaps"], 99)
    reference = results[("one", "long prompts")]["replies"]
    same = {layout: sum(a == b for a, b in zip(results[(layout, "long prompts")]["replies"], reference))
            for layout in LAYOUTS[1:]}
    text = "\n".join([
        f"## Prefill and decode pools vs whole-request workers ({datetime.date.today().isoformat()})", "",
        f"`{command}` on {cpu_name(cpu)}, {os.cpu_count()} cores: SmolLM2-135M (our engine, float32), "
        f"{args.streams} steady streams of {args.stream_tokens} tokens for {args.seconds:.0f} s per phase, then the "
        f"same while a prompt of ~{args.long_words} words ({args.long_tokens} tokens out) arrives every "
        f"{args.every:.0f} s. `one`: one worker on both cores; `two`: two whole-request workers, a core each "
        f"(taskset); `pools`: a prefill worker and a decode worker, a core each, sharing a host tier.", "",
        markdown_table(["layout", "phase", "ITL p50 ms", "ITL p99 ms", "long TTFT p50 ms", "long TTFT p99 ms",
                        "output tok/s", "long prompts"], rows), "",
        *verdicts,
        f"- target (pools' ITL p99 under long prompts at most 1.5x alone): {pools:.2f}x, "
        f"{'MET' if pools <= 1.5 else 'NOT MET'}",
        f"- KV loaded by the decode worker per handed-over request: {moved.get('bytes', 0) / 2**20:.1f} MiB "
        f"({moved.get('handovers', 0):.0f} hand-overs); blocks the workers' tier writers dropped, too far behind: "
        f"{moved.get('dropped', 0):.0f}",
        "- long prompts' greedy replies the same as `one`'s: " + ", ".join(
            f"{layout} {n}/{len(reference)}" for layout, n in same.items()),
    ]) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
