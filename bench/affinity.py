"""Cache-aware placement: multi-turn conversations over two workers of one model, with affinity on and off.
What share of the follow-up turns' prompt tokens come from a prefix cache, and what is the fifth turn's TTFT?

    .venv/bin/python bench/affinity.py                    # starts its own system, ~4 minutes on 2 CPU cores
    .venv/bin/python bench/affinity.py --conversations 12 --turns 5

It starts embedded NATS + Postgres in a temp dir and two workers (SmolLM2-135M from the model cache, one torch
thread each: two workers on two cores), then for each mode a gateway (``gateway.affinity`` on, then off) and
``--conversations`` conversations at once, each ``--turns`` turns in a row. Every conversation has a system
prompt of its own (about ``--system-words`` words), so only the worker that served it holds its prefix; each turn
resends the whole history, as chat clients do. Cached tokens are the usage's ``prompt_tokens_details``; TTFT is
send to first content chunk. Prints ``lscpu`` and appends the table to bench/RESULTS.md. Target: at least 80% of
follow-up prompt tokens from cache with affinity.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
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
from bench.overload import MODEL, ms, pct  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support.system import free_port  # noqa: E402

WORDS = ("river mountain ledger cobalt harbor lantern orchard falcon meadow quartz signal timber velvet willow "
         "anchor beacon canyon delta ember fjord glacier horizon island jasmine kestrel lagoon").split()


def system_prompt(rng: random.Random, words: int) -> str:
    return "You are the archivist of this record: " + " ".join(rng.choice(WORDS) for _ in range(words)) + "."


async def turn(http: httpx.AsyncClient, messages: list[dict], max_tokens: int) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    t0, ttft, text, usage = time.perf_counter(), None, [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {(await r.aread())[:200]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            obj = json.loads(line[6:])
            for choice in obj.get("choices") or []:
                content = choice["delta"].get("content")
                if content:
                    ttft = ttft or time.perf_counter() - t0
                    text.append(content)
            usage = obj.get("usage") or usage
    return {"ttft": ttft, "text": "".join(text), "prompt": usage["prompt_tokens"],
            "cached": usage["prompt_tokens_details"]["cached_tokens"]}


async def conversations(base_url: str, key: str, args, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, headers={"Authorization": f"Bearer {key}"}) as http:
        async def one(n: int) -> list[dict]:
            messages = [{"role": "system", "content": system_prompt(random.Random(seed * 1000 + n),
                                                                    args.system_words)}]
            turns = []
            for t in range(args.turns):
                messages.append({"role": "user", "content": f"Entry {t}: add one line about {rng.choice(WORDS)}."})
                result = await turn(http, messages, args.max_tokens)
                messages.append({"role": "assistant", "content": result["text"]})
                turns.append(result)
            return turns

        return await asyncio.gather(*(one(n) for n in range(args.conversations)))


def summarize(runs: list[list[dict]], turns: int) -> dict:
    follow = [t for conv in runs for t in conv[1:]]
    last = [conv[turns - 1]["ttft"] for conv in runs if conv[turns - 1]["ttft"] is not None]
    prompt = sum(t["prompt"] for t in follow)
    return {"share": sum(t["cached"] for t in follow) / prompt if prompt else 0.0, "prompt": prompt,
            "ttft_p50": pct(last, 50), "ttft_p95": pct(last, 95), "first_p50": pct([c[0]["ttft"] for c in runs], 50)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    # Fewer conversations than either worker has seats: both always have a free one, so without affinity a turn
    # goes to whichever worker pulls first (in a closed loop with every seat busy, the worker a turn just left is
    # the one with the free seat, and placement would look sticky by accident).
    p.add_argument("--conversations", type=int, default=6)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-words", type=int, default=400)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    cpu = lscpu()
    from switchyard.shared.config import GatewayConfig

    system, config, work = local_system("affinity", GatewayConfig(port=free_port()),
                                        {"torch_threads": 1, "max_num_seqs": args.max_num_seqs})
    results = {}
    try:
        system.start_servers()
        (api_key,) = asyncio.run(unlimited_keys(config.database_url, "pro", "affinity"))
        system.start_worker("worker-a")
        system.start_worker("worker-b")
        for seed, affinity in ((1, True), (2, False)):
            port = free_port()
            gateway = system.start_gateway(f"gateway-{'on' if affinity else 'off'}", port=port, affinity=affinity)
            system.wait_until_ready(MODEL, timeout_s=300, port=port)
            t0 = time.perf_counter()
            runs = asyncio.run(conversations(system.url(port), api_key, args, seed))
            results[affinity] = {**summarize(runs, args.turns), "wall": time.perf_counter() - t0}
            print(f"affinity {'on' if affinity else 'off'}: {results[affinity]}", flush=True)
            gateway.stop()
            system.services.remove(gateway)
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, results, command, cpu)
    return 0


def report(args, results: dict, command: str, cpu: str) -> None:
    model_name = cpu_name(cpu)
    rows = [[("on" if a else "off"), f"{r['share'] * 100:.1f}%", r["prompt"], ms(r["first_p50"]),
             ms(r["ttft_p50"]), ms(r["ttft_p95"]), f"{r['wall']:.1f}"] for a, r in results.items()]
    on = results[True]["share"]
    text = "\n".join([
        f"## Cache-aware placement: conversations over two workers ({datetime.date.today().isoformat()})", "",
        f"`{command}` on {model_name}, {os.cpu_count()} cores: two workers (SmolLM2-135M, one torch thread each, "
        f"max_num_seqs={args.max_num_seqs}), {args.conversations} conversations at once, {args.turns} turns each, "
        f"a system prompt of {args.system_words} words per conversation, max_tokens={args.max_tokens}.", "",
        markdown_table(["affinity", "follow-up prompt tokens from cache", "follow-up prompt tokens",
                        "turn-1 TTFT p50 ms", f"turn-{args.turns} TTFT p50 ms", f"turn-{args.turns} TTFT p95 ms",
                        "wall s"], rows), "",
        f"- with affinity: {on * 100:.1f}% of follow-up prompt tokens from cache (target >= 80%): "
        f"{'MET' if on >= 0.8 else 'NOT MET'}",
    ]) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
