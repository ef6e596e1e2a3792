"""Time one decode step of SmolLM2 (``ModelRunner.execute``) per attention backend and batch size.

    .venv/bin/python bench/decode_step.py                       # batches 1 3 8 32, context 50-528, 2 threads
    .venv/bin/python bench/decode_step.py --batches 32 --context 600 600
    .venv/bin/python bench/decode_step.py --backends cpu_paged --quantization int4 w8a8 --unfused

``--quantization``: the runner's weights (none, int8, w8a8, int4; default none). ``--unfused``: each quantized
runner also with its norms and SwiGLU as steps of their own (``Linear.after_rms_norm`` and ``after_silu_mul``
turned off), the two timed step by step in turn, so the gain of doing them inside the kernels is read in one run.

Each sequence decodes one token over a context drawn (fixed seed) from ``--context``; the cache is fp32. Prints the
median of ``--repeats`` steps per (backend, batch) and appends a table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.local import cpu_name, lscpu  # noqa: E402
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 3, 8, 32])
    p.add_argument("--context", type=int, nargs=2, default=[50, 528])
    p.add_argument("--backends", nargs="+", default=["sdpa", "cpu_paged"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--quantization", nargs="+", default=["none"], choices=["none", "int8", "w8a8", "int4"])
    p.add_argument("--unfused", action="store_true", help="also time each runner with its prologues unfused")
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args()

    import torch

    from switchyard.shared.config import SwitchyardConfig
    from switchyard.workers import model_store
    from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk

    report = lscpu()
    torch.set_num_threads(args.threads)
    model, _ = model_store.load(model_store.pull("smollm2", SwitchyardConfig().model_cache_dir),
                                dtype="float32", device="cpu")
    block_size = 16
    rows = []
    for backend in args.backends:
        for quantization in args.quantization:
            rng = random.Random(0)
            runner = ModelRunner(model, 64 * (args.context[1] // block_size + 2), block_size,
                                 attention_backend=backend,
                                 quantization=None if quantization == "none" else quantization)
            runner.warmup()
            arms = ["fused", "unfused"] if args.unfused and quantization != "none" else ["fused"]
            for batch in args.batches:
                chunks, next_block = [], 0
                for _ in range(batch):
                    context = rng.randint(*args.context)
                    num_blocks = context // block_size + 1
                    chunks.append(SeqChunk([5], context, list(range(next_block, next_block + num_blocks)), True))
                    next_block += num_blocks
                times: dict[str, list[float]] = {arm: [] for arm in arms}
                for repeat in range(args.repeats + 1):  # the first of each arm warms it
                    for arm in arms:
                        with _unfused(arm == "unfused"):
                            t = time.perf_counter()
                            runner.execute(chunks)
                            if repeat:
                                times[arm].append(time.perf_counter() - t)
                mean_context = sum(c.start_pos for c in chunks) / batch
                for arm in arms:
                    name = backend if quantization == "none" else f"{backend} {quantization} {arm}"
                    rows.append((name, batch, mean_context, statistics.median(times[arm]) * 1e3))
                    print(f"{name:24s} batch {batch:3d} mean context {mean_context:5.0f}: {rows[-1][3]:7.1f} ms",
                          flush=True)

    table = markdown_table(("backend", "sequences", "mean context", "step ms (median)"),
                           [(b, n, f"{c:.0f}", f"{ms:.1f}") for b, n, c, ms in rows])
    append_section(f"## bench/decode_step.py\n\n`{command_line()}` (SmolLM2 fp32, {args.threads} threads, "
                   f"{args.repeats} steps each)\n\nMachine: {cpu_name(report)}, {os.cpu_count()} CPUs.\n\n{table}\n",
                   args.results)


@contextlib.contextmanager
def _unfused(on: bool):
    """While ``on``: every Linear does its norm and SwiGLU as steps of their own (the path before the kernels
    took them as prologues)."""
    from switchyard.workers.executor.linear import Linear

    if not on:
        yield
        return
    fused = Linear.after_rms_norm, Linear.after_silu_mul
    Linear.after_rms_norm = lambda self, h, weight, eps, ops: self(ops.rms_norm(h, weight, eps))
    Linear.after_silu_mul = lambda self, gate_up, ops, residual=None: self(ops.silu_mul(gate_up), residual=residual)
    try:
        yield
    finally:
        Linear.after_rms_norm, Linear.after_silu_mul = fused

if __name__ == "__main__":
    main()
