"""Time one decode step of SmolLM2 (``ModelRunner.execute``) per attention backend and batch size.

    .venv/bin/python bench/decode_step.py                       # batches 1 3 8 32, context 50-528, 2 threads
    .venv/bin/python bench/decode_step.py --batches 32 --context 600 600

Each sequence decodes one token over a context drawn (fixed seed) from ``--context``; the cache is fp32. Prints the
median of ``--repeats`` steps per (backend, batch) and appends a table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 3, 8, 32])
    p.add_argument("--context", type=int, nargs=2, default=[50, 528])
    p.add_argument("--backends", nargs="+", default=["sdpa", "cpu_paged"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args()

    import torch

    from switchyard.shared.config import SwitchyardConfig
    from switchyard.workers import model_store
    from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk

    torch.set_num_threads(args.threads)
    model, _ = model_store.load(model_store.pull("smollm2", SwitchyardConfig().model_cache_dir),
                                dtype="float32", device="cpu")
    block_size = 16
    rows = []
    for backend in args.backends:
        rng = random.Random(0)
        runner = ModelRunner(model, 64 * (args.context[1] // block_size + 2), block_size, attention_backend=backend)
        runner.warmup()
        for batch in args.batches:
            chunks, next_block = [], 0
            for _ in range(batch):
                context = rng.randint(*args.context)
                num_blocks = context // block_size + 1
                chunks.append(SeqChunk([5], context, list(range(next_block, next_block + num_blocks)), True))
                next_block += num_blocks
            runner.execute(chunks)
            times = []
            for _ in range(args.repeats):
                t = time.perf_counter()
                runner.execute(chunks)
                times.append(time.perf_counter() - t)
            mean_context = sum(c.start_pos for c in chunks) / batch
            rows.append((backend, batch, mean_context, statistics.median(times) * 1e3))
            print(f"{backend:10s} batch {batch:3d} mean context {mean_context:5.0f}: {rows[-1][3]:7.1f} ms",
                  flush=True)

    table = markdown_table(("backend", "sequences", "mean context", "step ms (median)"),
                           [(b, n, f"{c:.0f}", f"{ms:.1f}") for b, n, c, ms in rows])
    append_section(f"## bench/decode_step.py\n\n`{command_line()}` (SmolLM2 fp32, {args.threads} threads, "
                   f"{args.repeats} steps each)\n\n{table}\n", args.results)

if __name__ == "__main__":
    main()
