"""Which dtype runs a model fastest on this CPU: float32 through the compiled kernels, or bfloat16 through torch
(oneDNN, with AMX where the chip has it).

Neither wins everywhere. Without avx512_bf16/AMX, torch emulates bf16 and it loses badly (several times slower
than fp32), so fp32 is taken without measuring. With them it depends on the chip: with AMX bf16 runs the engine
well ahead of fp32 with the C kernels; with avx512_bf16 but no AMX the two are close. So there ``--dtype auto``
measures the model's own projection shapes in both dtypes (a fraction of a second) at each decode batch size, and
remembers the answer per CPU model, torch version, thread count and shape in ``<cache>/switchyard/dtype/``.

bf16 is taken only where its projections are faster at every batch size. The rest of a bf16 step (attention
widening a bf16 cache, elementwise ops in bf16) costs more than fp32's, so a split is a loss: on an AMD EPYC with
avx512_bf16 (2 threads, SmolLM2) bf16's projections were 1.9x slower at 1 row and 2.7x faster at 32, and the engine
in bf16 gave 28 / 130 / 340 tok/s at 1 / 8 / 32 streams against fp32's 60 / 182 / 339 (``bench/quantization.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import statistics
import time
from pathlib import Path

import torch

from switchyard.workers.executor import kernels
from switchyard.workers.executor.linear import Linear, uses_packed_kernel

log = logging.getLogger("switchyard.cpu_dtype")

DECODE_ROWS = (1, 8, 32)  # batch sizes a decode step runs at


def has_native_bf16() -> bool:
    """Whether this CPU does bf16 arithmetic in hardware (x86 avx512_bf16 or AMX, Arm's bf16 extension)."""
    return bool(set(kernels.cpu_flags().split()) & {"avx512_bf16", "amx_bf16", "bf16"})


def _time_projections(dtype: torch.dtype, hidden: int, intermediate: int) -> list[float]:
    """Seconds for the MLP projections of one layer at each decode batch size (``DECODE_ROWS``; median of 5
    rounds)."""
    gen = torch.Generator().manual_seed(0)
    pack = uses_packed_kernel(torch.device("cpu"), dtype)
    gate_up = Linear((torch.randn(2 * intermediate, hidden, generator=gen) * 0.02).to(dtype), pack=pack)
    down = Linear((torch.randn(hidden, intermediate, generator=gen) * 0.02).to(dtype), pack=pack)
    inputs = [torch.randn(rows, hidden, generator=gen).to(dtype) for rows in DECODE_ROWS]
    rounds: list[list[float]] = [[] for _ in inputs]
    for _ in range(6):
        for x, times in zip(inputs, rounds):
            t0 = time.perf_counter()
            up = gate_up(x)
            down(up[:, :intermediate].contiguous())
            times.append(time.perf_counter() - t0)
    return [statistics.median(times[1:]) for times in rounds]


def fastest_cpu_dtype(hidden: int, intermediate: int, cache: Path | None = None) -> torch.dtype:
    """float32 or bfloat16, whichever runs this model's projections faster on this CPU (see the module doc)."""
    if not has_native_bf16():
        return torch.float32
    model = kernels.cpu_model()
    # "every-size": answers cached by the rule before it (the sum of all sizes) are not reused.
    key_text = (f"every-size|{model}|{kernels.cpu_flags()}|{torch.__version__}|{torch.get_num_threads()}|"
                f"{hidden}x{intermediate}")
    key = hashlib.sha256(key_text.encode()).hexdigest()[:16]
    path = (cache or kernels.cache_dir().parent / "dtype") / f"{key}.json"
    try:
        return getattr(torch, json.loads(path.read_text())["dtype"])
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    times = {name: _time_projections(getattr(torch, name), hidden, intermediate) for name in ("float32", "bfloat16")}
    best = "bfloat16" if all(b < f for b, f in zip(times["bfloat16"], times["float32"])) else "float32"
    shown = {name: " / ".join(f"{t * 1e3:.2f}" for t in ts) for name, ts in times.items()}
    log.info("dtype auto on %s: a layer's projections at %s rows took fp32 %s ms, bf16 %s ms -> %s (cached in %s)",
             model, " / ".join(map(str, DECODE_ROWS)), shown["float32"], shown["bfloat16"], best, path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"dtype": best, "cpu": model, "threads": torch.get_num_threads(),
                                   "ms": {k: [round(t * 1e3, 3) for t in v] for k, v in times.items()}}))
        os.replace(tmp, path)
    except OSError as exc:
        log.warning("could not cache the dtype choice in %s: %s", path, exc)
    return getattr(torch, best)
