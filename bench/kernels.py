"""Time the CPU kernels against what torch would do instead, on SmolLM2-135M's shapes (fp32).

    .venv/bin/python bench/kernels.py                    # 2 threads, all rows and prefill sizes below
    .venv/bin/python bench/kernels.py --rows 1 8 32 --prefills 0:512
    .venv/bin/python bench/kernels.py --quantized --rows 1 8 32 --prefills    # w8a8 and int4 beside packed fp32

* projections: every matrix of the model once (30 layers of qkv, o, gate_up, down, plus the 49152-row LM head) for
  ``--rows`` rows of input, by MKL (``x @ W.T``, or ``(W @ x.T).T`` where that is faster: the fallback's rule) and by
  the packed kernel (``workers/linear.py``); weight bytes over the packed time is the bandwidth it reached; with
  ``--quantized``, the same through the w8a8 and int4 kernels (their own bytes: 1 and 0.625 a weight), and the time
  of a call whose weight is tiny (16 x 32): what each call costs whatever its size;
* prefill attention: one chunk of ``start:tokens`` through 30 layers, SDPA against ``csrc/prefill_attention.c``.

Both run alternately in one process and the median of ``--repeats`` is reported, so drift of a shared machine
affects both alike. Random weights: speed does not depend on the values. Appends a table to bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.results import RESULTS, append_section, command_line, markdown_table  # noqa: E402

LAYERS = 30
LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate_up, down: [out, in]
LM_HEAD = (49152, 576)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def alternate(fns: dict, repeats: int) -> dict:
    """Median seconds of each callable, run in turns after one untimed warm-up each."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def bench_projections(rows_list, repeats):
    import torch

    from switchyard.workers.executor.linear import Linear

    weights = [torch.randn(*s) for s in LAYER_SHAPES for _ in range(LAYERS)] + [torch.randn(*LM_HEAD)]
    unpacked = [Linear(w) for w in weights]  # torch: MKL, transposed where that is faster
    packed = [Linear(w, pack=True) for w in weights]
    weight_bytes = sum(w.numel() * 4 for w in weights)
    out = []
    for rows in rows_list:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}

        def run(linears):
            for lin in linears:
                lin(xs[lin.weight.shape[1]])

        t = alternate({"mkl": lambda: run(unpacked), "packed": lambda: run(packed)}, repeats)
        flops = 2 * rows * sum(w.numel() for w in weights)
        out.append((rows, t["mkl"], t["packed"], flops, weight_bytes))
        print(f"projections, {rows:4d} rows: MKL {t['mkl'] * 1e3:7.1f} ms, packed {t['packed'] * 1e3:7.1f} ms "
              f"({flops / t['packed'] / 1e9:.0f} GFLOP/s, weights at {weight_bytes / t['packed'] / 1e9:.1f} GB/s)",
              flush=True)
    return out


def bench_quantized(rows_list, repeats):
    """Rows of (rows, kind, seconds for every matrix, bytes its weights take, seconds of one call on a 16 x 32
    weight) for packed fp32, w8a8 and int4."""
    import torch

    from switchyard.workers.executor.linear import Linear

    weights = [torch.randn(*s) for s in LAYER_SHAPES for _ in range(LAYERS)]
    kinds = {"fp32": {"pack": True}, "w8a8": {"quantize": "w8a8"}, "int4": {"quantize": "int4"}}
    linears = {kind: [Linear(w, **kw) for w in weights] for kind, kw in kinds.items()}
    tiny = {kind: Linear(torch.randn(16, 32), **kw) for kind, kw in kinds.items()}
    numel = sum(w.numel() for w in weights)
    per_weight = {"fp32": 4.0, "w8a8": 1.0 + 8 / 32, "int4": 0.5 + 4 / 32}  # weights, and scales per group
    out = []
    for rows in rows_list:
        xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
        x_tiny = torch.randn(rows, 32)

        def run(kind):
            for lin, w in zip(linears[kind], weights):
                lin(xs[w.shape[1]])

        def calls(kind, n=200):
            for _ in range(n):
                tiny[kind](x_tiny)

        t = alternate({kind: (lambda kind=kind: run(kind)) for kind in kinds}, repeats)
        c = alternate({kind: (lambda kind=kind: calls(kind)) for kind in kinds}, repeats)
        for kind in kinds:
            nbytes = numel * per_weight[kind]
            out.append((rows, kind, t[kind], nbytes, c[kind] / 200))
            print(f"{kind:5s} {rows:3d} rows: {t[kind] * 1e3:6.2f} ms for {len(weights)} matrices, "
                  f"{nbytes / t[kind] / 1e9:5.1f} GB/s; a tiny call {c[kind] / 200 * 1e6:5.1f} us", flush=True)
    return out


def bench_prefill(prefills, repeats):
    import torch

    from switchyard.workers.executor.attention import SdpaAttention
    from switchyard.workers.executor.attention.cpu_paged import CpuPagedAttention

    cpu = torch.device("cpu")
    out = []
    for start, tokens in prefills:
        context = start + tokens
        num_blocks = context // BLOCK + 1
        chunks = [(start, tokens, list(range(num_blocks)))]
        shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
        caches = [(torch.randn(shape), torch.randn(shape)) for _ in range(LAYERS)]
        q = torch.randn(tokens, HEADS, HEAD_DIM)
        k, v = torch.randn(tokens, KV_HEADS, HEAD_DIM), torch.randn(tokens, KV_HEADS, HEAD_DIM)
        fns = {}
        for name, cls in (("sdpa", SdpaAttention), ("kernel", CpuPagedAttention)):
            backend = cls(HEADS, KV_HEADS, HEAD_DIM, BLOCK, cpu)
            meta = backend.prepare(chunks)
            fns[name] = lambda backend=backend, meta=meta: [backend.forward(q, k, v, kc, vc, meta) for kc, vc in caches]
        t = alternate(fns, repeats)
        out.append((start, tokens, t["sdpa"], t["kernel"]))
        print(f"prefill attention, start {start:4d}, {tokens:4d} tokens, {LAYERS} layers: "
              f"SDPA {t['sdpa'] * 1e3:6.1f} ms, kernel {t['kernel'] * 1e3:6.1f} ms", flush=True)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 128, 512])
    p.add_argument("--prefills", nargs="*", default=["0:128", "0:512", "200:480"], help="start:tokens")
    p.add_argument("--quantized", action="store_true", help="w8a8 and int4 projections beside packed fp32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--results", default=str(RESULTS))
    args = p.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    projections = bench_projections(args.rows, args.repeats)
    prefills = bench_prefill([tuple(int(x) for x in s.split(":")) for s in args.prefills], args.repeats)

    quantized = ""
    if args.quantized:
        quantized = markdown_table(("rows", "weights", "ms (120 matrices)", "GB/s", "us a tiny call"),
                                   [(r, kind, f"{t * 1e3:.2f}", f"{b / t / 1e9:.1f}", f"{c * 1e6:.1f}")
                                    for r, kind, t, b, c in bench_quantized(args.rows, args.repeats)])
    gemm = markdown_table(("rows", "MKL ms", "packed ms", "packed GFLOP/s", "weights GB/s (packed)"),
                          [(r, f"{m * 1e3:.1f}", f"{k * 1e3:.1f}", f"{f / k / 1e9:.0f}", f"{b / k / 1e9:.1f}")
                           for r, m, k, f, b in projections])
    attention = markdown_table(("prefill chunk (start, tokens)", "SDPA ms (30 layers)", "kernel ms"),
                               [(f"{s}, {n}", f"{a * 1e3:.1f}", f"{b * 1e3:.1f}") for s, n, a, b in prefills])
    append_section(f"## bench/kernels.py\n\n`{command_line()}` (SmolLM2 shapes, fp32, {args.threads} threads, "
                   f"median of {args.repeats}, run alternately)\n\n{gemm}\n\n{attention}\n{quantized}\n",
                   args.results)

if __name__ == "__main__":
    main()
