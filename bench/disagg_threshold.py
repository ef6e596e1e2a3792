"""Where handing a prompt over stops paying: the prompt length above which a request is worth prefilling apart.

    .venv/bin/python bench/disagg_threshold.py            # starts its own system; ~5 minutes on 2 CPU cores

Issue 39's part 3, on one machine: a prefill worker and a decode worker of SmolLM2-135M (our engine), each pinned
to a core of its own (``taskset``), sharing a host KV tier, and two gateways in front of them: one that hands every
prompt over (``prefill_min_prompt_tokens`` 1) and one that hands none over (the decode worker prefills it). For
each prompt length, ``--repeats`` requests through each, one at a time on an idle system, every prompt new (no
prefix cached anywhere), ``--tokens`` tokens out. Reported per length and path: TTFT, the gap before the second
token (where a handed-over request waits for its hand-over: the prefill's blocks written, the continuation queued,
the decode worker's load), the usual gap between tokens after it, and the whole request's time.

The rule it measures: a hand-over is worth it when the prefill it takes off the decode worker (``prefill on
decode``: the whole path's TTFT above the shortest prompt's, i.e. what a prefill there stalls the decode worker's
other streams by) is longer than the pause it puts in the request's own stream (``hand-over pause``: the split
path's second-token gap above its usual gap). The smallest length where that holds is the threshold printed, the
``gateway.prefill_min_prompt_tokens`` to set on this hardware. Prints ``lscpu`` and appends to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.affinity import WORDS  # noqa: E402
from bench.disagg import live, pin, stream  # noqa: E402
from bench.local import MODEL, cpu_name, local_system, lscpu, unlimited_keys  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402
from tests.support.system import free_port  # noqa: E402

PATHS = ("split", "whole")


def prompts_of(model_dir: Path, lengths: list[int], count: int) -> dict[int, list[str]]:
    """``count`` new prompts of about each length in tokens, each starting differently (nothing cached: the decode
    worker keeps a handed-over prompt's blocks, so each path gets prompts of its own)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    rng = random.Random(7)
    out: dict[int, list[str]] = {}
    for length in lengths:
        out[length] = []
        for i in range(count):
            text = f"Ledger {length}-{i}: " + " ".join(rng.choice(WORDS) for _ in range(length))
            out[length].append(tokenizer.decode(tokenizer(text).input_ids[:length]))
    return out


async def measure(urls: dict[str, str], key: str, prompts: dict[int, list[str]], tokens: int) -> dict:
    """Per (length, path): a list of (TTFT, second-token gap, median later gap, total) in s. Each length's
    prompts alternate between the paths."""
    out: dict[tuple[int, str], list[tuple[float, float, float, float]]] = {}
    async with httpx.AsyncClient(timeout=600) as http:
        for length, texts in prompts.items():
            for i in range(len(texts) // 2):
                # Alternate which path goes first, so neither always follows the other's warm-up.
                for path in PATHS if i % 2 == 0 else PATHS[::-1]:
                    http.base_url = httpx.URL(urls[path])
                    t0 = time.perf_counter()
                    ttft, gaps, _ = await stream(http, key, texts[2 * i + PATHS.index(path)], tokens)
                    total = time.perf_counter() - t0
                    out.setdefault((length, path), []).append(
                        (ttft, gaps[0], statistics.median(gaps[1:]), total))
                print(f"{length} tokens, prompt {i + 1}/{len(texts) // 2}: " + ", ".join(
                    f"{p} TTFT {out[(length, p)][-1][0] * 1000:.0f} ms, 2nd gap {out[(length, p)][-1][1] * 1000:.0f} ms"
                    for p in PATHS), flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lengths", default="16,32,48,64,96,128,256,512,1024,2048", help="prompt lengths in tokens")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--tokens", type=int, default=16, help="tokens out per request")
    p.add_argument("--results", type=Path, default=RESULTS, help="'-' to skip")
    args = p.parse_args()
    command = command_line()
    cpu = lscpu()
    from switchyard.shared.config import GatewayConfig

    lengths = sorted(int(n) for n in args.lengths.split(","))
    settings = {"max_num_seqs": 8, "kv_offload_gib": 2.0, "dtype": "float32", "torch_threads": 1}
    ports = {"split": free_port(), "whole": free_port()}
    system, config, work = local_system("disagg-threshold", GatewayConfig(port=ports["split"]), settings)
    try:
        prompts = prompts_of(Path(config.worker.model), lengths, 2 * args.repeats)
        system.start_servers()
        (api_key,) = asyncio.run(unlimited_keys(config.database_url, "pro", "threshold"))
        system.start_gateway(prefill_min_prompt_tokens=1)
        system.start_gateway("gateway-whole", port=ports["whole"], run_jobs=False,
                             prefill_min_prompt_tokens=10**9)
        workers = [system.start_worker(f"worker-{role}", role=role) for role in ("prefill", "decode")]
        system.wait_until_ready(MODEL, timeout_s=300)
        asyncio.run(asyncio.wait_for(live(config.nats_url, len(workers)), 300))
        for core, worker in enumerate(workers):
            pin(worker, core)
        urls = {path: f"http://127.0.0.1:{port}" for path, port in ports.items()}
        # A first request through each, untimed: the first prompt of a worker pays for its warm-up.
        asyncio.run(measure(urls, api_key, prompts_of(Path(config.worker.model), [lengths[-1] + 1], 2), args.tokens))
        times = asyncio.run(measure(urls, api_key, prompts, args.tokens))
    finally:
        system.stop()
        shutil.rmtree(work, ignore_errors=True)
    report(args, lengths, times, command, cpu)
    return 0


def report(args, lengths: list[int], times: dict, command: str, cpu: str) -> None:
    def med(length: int, path: str, field: int) -> float:
        return statistics.median(t[field] for t in times[(length, path)])

    base = med(lengths[0], "whole", 0)
    rows, threshold = [], None
    for length in lengths:
        saved = med(length, "whole", 0) - base  # the prefill a hand-over takes off the decode worker
        pause = med(length, "split", 1) - med(length, "split", 2)  # the pause it puts in the request's stream
        worth = saved > pause
        if worth and threshold is None:
            threshold = length
        rows.append([length, *(f"{med(length, path, 0) * 1000:.0f}" for path in PATHS),
                     f"{med(length, 'split', 1) * 1000:.0f}", f"{med(length, 'split', 2) * 1000:.0f}",
                     *(f"{med(length, path, 3) * 1000:.0f}" for path in PATHS),
                     f"{saved * 1000:.0f}", f"{pause * 1000:.0f}", "yes" if worth else "no"])
    text = "\n".join([
        f"## When a prompt is worth prefilling apart ({datetime.date.today().isoformat()})", "",
        f"`{command}` on {cpu_name(cpu)}, {os.cpu_count()} cores: SmolLM2-135M (our engine, float32), a prefill "
        f"worker and a decode worker a core each (taskset), one request at a time, {args.repeats} new prompts per "
        f"length, {args.tokens} tokens out; medians. `split`: handed over (prefill worker, then decode worker); "
        "`whole`: prefilled on the decode worker.", "",
        markdown_table(["prompt tokens", "TTFT split ms", "TTFT whole ms", "split 2nd-token gap ms",
                        "split later gap ms", "total split ms", "total whole ms", "prefill on decode ms",
                        "hand-over pause ms", "worth it"], rows), "",
        f"- threshold (the shortest prompt whose prefill on the decode worker outlasts the hand-over's pause): "
        f"{threshold if threshold is not None else 'none of these lengths'} tokens",
    ]) + "\n"
    print("\n" + text)
    append_section(text, args.results)


if __name__ == "__main__":
    sys.exit(main())
