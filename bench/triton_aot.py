"""The engine's Triton kernels compiled ahead of time for real GPUs, on a machine without one.

    python bench/gpu.py --compile-only          # every kernel, sm_80 and sm_90, fp32/bf16/fp16, every model family

The kernels: attention (``triton_kernels.py``) at each family's head shapes, and the int8 projection
(``triton_int8.py``) at its layer and vocabulary sizes.

CI runs the kernels under Triton's interpreter, which never compiles them (and skips bf16): without this, a GPU
session would be their first compile. Here ``TritonAttention`` launches its kernels into a ``LaunchRecorder`` at a
model family's head shapes, and each distinct launch is compiled for each target with Triton's own binder, the
code a GPU launch runs to decide what to specialise (``specialization``). So what compiles here is what a GPU's
first step would compile, ptxas included (Triton's wheel brings its own).

The same key says when a kernel would compile again: ``tests/workers/test_triton_specialization.py`` asserts that
a served workload launches nothing that the engine's start (warm-up and graph capture) did not already compile.

Triton internals used (present in 3.6, the GPU image's, and 3.9, CI's): ``create_function_from_signature`` and
``JITFunction._pack_args``; a Triton without them fails here with that said, not silently.
"""

from __future__ import annotations

import functools
import os
import re
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path

import torch

KERNELS = ("_prefill_kernel", "_decode_split_kernel", "_decode_reduce_kernel")  # attention (triton_kernels.py)
# projections with int8 weights (triton_int8.py) and with 4-bit ones (triton_int4.py)
LINEAR_KERNELS = ("_int8_linear_kernel", "_int4_linear_kernel")
# (compute capability, the most shared memory one block may take there): a kernel over it compiles but cannot
# launch ("out of resource: shared memory"), so that is checked too.
TARGETS = {"sm_80": (80, 163 * 1024), "sm_90": (90, 227 * 1024)}
# query heads, KV heads, head size
FAMILIES = {
    "Llama-3-8B": (32, 8, 128),
    "Llama-3-70B": (64, 8, 128),
    "SmolLM2-135M": (9, 3, 64),
    "SmolLM2-360M": (15, 5, 64),
    "SmolLM2-1.7B": (32, 32, 64),
}
# hidden size, intermediate size, vocabulary, q/k/v output features: the projections int8 and int4 weights run
# through (workers/executor/triton_int8.py, triton_int4.py)
LINEAR_SHAPES = {
    "Llama-3-8B": (4096, 14336, 128256, 6144),
    "Llama-3-70B": (8192, 28672, 128256, 10240),
    "SmolLM2-135M": (576, 1536, 49152, 960),
    "SmolLM2-360M": (960, 2560, 49152, 1600),
    "SmolLM2-1.7B": (2048, 8192, 49152, 6144),
}
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
BLOCK_SIZE = 16  # the engine's default KV block (EngineConfig.block_size)


@dataclass(slots=True)
class Launch:
    kernel: str
    args: tuple
    kwargs: dict


class LaunchRecorder:
    """Stands in for the ``triton_kernels`` module of a ``TritonAttention`` (its ``kernels``): every
    ``kernel[grid](...)`` is recorded in ``launches``, and run on the real kernel when ``run`` is set."""

    def __init__(self, kernels, run: bool) -> None:
        self._kernels = kernels
        self._run = run
        self.launches: list[Launch] = []

    def __getattr__(self, name: str) -> _RecordedKernel:
        return _RecordedKernel(self, name)


@dataclass(slots=True)
class _RecordedKernel:
    recorder: LaunchRecorder
    name: str

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.recorder.launches.append(Launch(self.name, args, kwargs))
            if self.recorder._run:
                return getattr(self.recorder._kernels, self.name)[grid](*args, **kwargs)
            return None

        return launch


@functools.cache
def compiled_form(kernel):
    """The ``JITFunction`` of a kernel, also of one made under ``TRITON_INTERPRET=1`` (an ``InterpretedFunction``
    keeps the Python function and the decorator's arguments; such a one can be bound, not compiled)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    options = getattr(kernel, "kwargs", {})
    return JITFunction(kernel.fn, do_not_specialize=options.get("do_not_specialize"),
                       do_not_specialize_on_alignment=options.get("do_not_specialize_on_alignment"))


def _gpu_target(target: str):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("cuda", TARGETS[target][0], 32)


_binders: dict[tuple[int, str], tuple] = {}  # by (id of the kernel, target); a JITFunction's hash reads its source


def _binder(kernel, target: str):
    """Triton's own argument binder of ``kernel`` for ``target``, and the target's backend."""
    import triton
    from triton.compiler import make_backend
    from triton.runtime import jit

    if (id(kernel), target) not in _binders:
        if not hasattr(jit, "create_function_from_signature") or not hasattr(kernel, "_pack_args"):
            raise RuntimeError(f"Triton {triton.__version__} lacks the binder this uses (see bench/triton_aot.py)")
        backend = make_backend(_gpu_target(target))
        binder = jit.create_function_from_signature(kernel.signature, kernel.params, backend)
        _binders[id(kernel), target] = (kernel, backend, binder)
    return _binders[id(kernel), target][1:]


def _bind(kernel, launch: Launch, target: str):
    backend, binder = _binder(kernel, target)
    bound, specialization, options = binder(*launch.args, **launch.kwargs)
    return backend, bound, specialization, options


def specialization(kernels, launch: Launch, target: str = "sm_90") -> tuple:
    """What a launch on ``target`` is compiled for (Triton caches a kernel per this key): argument types, the
    integers it treats as constants or multiples of 16, the pointers it assumes aligned, and the options."""
    kernel = compiled_form(getattr(kernels, launch.kernel))
    _, _, spec, options = _bind(kernel, launch, target)
    return (launch.kernel, tuple(map(tuple, spec)), tuple(sorted(options.items())) if isinstance(options, dict)
            else options)


def compile_launch(kernels, launch: Launch, target: str):
    """Compile one recorded launch for ``target`` as its first launch there would; returns Triton's kernel."""
    import triton
    from triton.compiler import ASTSource

    kernel = compiled_form(getattr(kernels, launch.kernel))
    backend, bound, spec, options = _bind(kernel, launch, target)
    options, signature, constexprs, attrs = kernel._pack_args(backend, launch.kwargs, bound, spec, options)
    return triton.compile(ASTSource(kernel, signature, constexprs, attrs), target=_gpu_target(target),
                          options=options.__dict__)


def record_launches(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                    block_size: int = BLOCK_SIZE) -> list[Launch]:
    """The launches of one step with every kind of chunk (a prefill from scratch, one after a cached prefix that
    ends mid-block, decodes at short and long contexts), at these head shapes, on CPU tensors, nothing run."""
    from switchyard.workers.executor.attention.triton_paged import TritonAttention

    attention = TritonAttention(num_heads, num_kv_heads, head_dim, block_size, torch.device("cpu"), dtype)
    recorder = LaunchRecorder(attention.kernels, run=False)
    attention.kernels = recorder
    shapes = [(0, 70), (20, 33), (100, 1), (5, 1), (300, 1)]
    chunks, used = [], 0
    for start, n in shapes:
        blocks = -(-(start + n) // block_size)
        chunks.append((start, n, list(range(used, used + blocks))))
        used += blocks
    rows = sum(n for _, n in shapes)
    q = torch.zeros(rows, num_heads, head_dim, dtype=dtype)
    k = torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype)
    k_cache = torch.zeros(used, block_size, num_kv_heads, head_dim, dtype=dtype)
    attention.forward(q, k, k.clone(), k_cache, k_cache.clone(), attention.prepare(chunks))
    return recorder.launches


def record_linear_launches(family: str, dtype: torch.dtype) -> list[Launch]:
    """The int8 and int4 projections' launches of one family (q/k/v, o, gate/up, down, LM head; with and without a
    bias), as ``triton_int8.int8_linear`` and ``triton_int4.int4_linear`` make them, on CPU tensors, nothing run."""
    from switchyard.workers.executor import triton_int4, triton_int8

    hidden, intermediate, vocab, qkv = LINEAR_SHAPES[family]
    launches = []
    for n, k, bias in ((qkv, hidden, True), (qkv, hidden, False), (hidden, hidden, False),
                       (2 * intermediate, hidden, False), (hidden, intermediate, False), (vocab, hidden, False)):
        rows = 8
        x, q = torch.zeros(rows, k, dtype=dtype), torch.zeros(n, k, dtype=torch.int8)
        scales, y = torch.zeros(n), torch.zeros(rows, n, dtype=dtype)
        launches.append(Launch("_int8_linear_kernel", (x, q, scales, scales, y, rows, n, k, k, k, n), dict(
            HAS_BIAS=bias, PRECISION="ieee" if dtype == torch.float32 else "tf32", BLOCK_M=triton_int8.BLOCK_M,
            BLOCK_N=triton_int8.BLOCK_N, BLOCK_K=triton_int8.BLOCK_K)))
        groups = -(-k // triton_int4.GROUP)
        packed, scales = torch.zeros(n, groups * 16, dtype=torch.uint8), torch.zeros(n, groups, dtype=torch.float16)
        launches.append(Launch("_int4_linear_kernel", (x, packed, scales, scales, scales, y, rows, n, k, k,
                                                       groups * 16, groups, n), dict(
            HAS_BIAS=bias, PRECISION="ieee" if dtype == torch.float32 else "tf32", BLOCK_M=triton_int4.BLOCK_M,
            BLOCK_N=triton_int4.BLOCK_N)))
    return launches


class _Kernels:
    """Every kernel by its name: the attention kernels' module, then the int8 and int4 projections'."""

    def __getattr__(self, name: str):
        from switchyard.workers.executor import triton_int4, triton_int8
        from switchyard.workers.executor.attention import triton_kernels

        return (getattr(triton_kernels, name, None) or getattr(triton_int8, name, None)
                or getattr(triton_int4, name))


@dataclass(slots=True)
class Compiled:
    family: str
    dtype: str
    target: str
    kernel: str
    seconds: float
    shared_bytes: int
    cubin_bytes: int
    registers: int | None  # per thread, as ptxas allotted them (None: no cuobjdump to read them)
    spill_bytes: int | None  # local memory per thread: registers spilled
    error: str | None

    @property
    def problem(self) -> str | None:
        """Why this kernel cannot run on its target (a compile error, or more shared memory than a block may
        take there); None when it can."""
        if self.error is not None:
            return self.error
        limit = TARGETS[self.target][1]
        if self.shared_bytes > limit:
            return f"needs {self.shared_bytes} bytes of shared memory, {self.target} has {limit}"
        return None


def compile_family(family: str, dtype_name: str, targets: tuple[str, ...]) -> list[Compiled]:
    """Every distinct launch of one family and dtype, compiled for each target."""
    triton_kernels = _Kernels()
    dtype = getattr(torch, dtype_name)
    launches = record_launches(*FAMILIES[family], dtype) + record_linear_launches(family, dtype)
    results = []
    for target in targets:
        seen = set()
        for launch in launches:
            key = specialization(triton_kernels, launch, target)
            if key in seen:
                continue
            seen.add(key)
            start = time.perf_counter()
            try:
                compiled = compile_launch(triton_kernels, launch, target)
                shared, cubin, error = int(compiled.metadata.shared), compiled.asm["cubin"], None
            except Exception as exc:  # noqa: BLE001 - the compiler's message is the result
                shared, cubin, error = 0, b"", f"{type(exc).__name__}: {str(exc)[:600]}"
            seconds = time.perf_counter() - start
            registers, spills = resource_usage(cubin) if cubin else (None, None)
            results.append(Compiled(family, dtype_name, target, launch.kernel, seconds, shared, len(cubin),
                                    registers, spills, error))
    return results


def resource_usage(cubin: bytes) -> tuple[int | None, int | None]:
    """(registers per thread, local memory bytes per thread) of a compiled kernel, read with the cuobjdump that
    Triton's wheel brings; (None, None) without one."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.exists():
        return None, None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.run([str(tool), "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+).*?LOCAL:(\d+)", usage)
    return (int(found.group(1)), int(found.group(2))) if found else (None, None)


def compile_all(families=tuple(FAMILIES), dtypes=DTYPES, targets=tuple(TARGETS),
                jobs: int | None = None) -> Iterator[Compiled]:
    """Compile every family x dtype (each for every target) in ``jobs`` processes, into a fresh Triton cache so
    that each one really compiles; yields results as each family and dtype finishes."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1 is set: interpreted kernels cannot be compiled (unset it)")
    work = [(family, str(dtype).removeprefix("torch."), tuple(targets)) for family in families for dtype in dtypes]
    previous = os.environ.get("TRITON_CACHE_DIR")
    with tempfile.TemporaryDirectory(prefix="switchyard-triton-aot-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # the spawned processes take it from here
        try:
            # spawn, not fork: the parent has torch (and its threads) loaded.
            with ProcessPoolExecutor(jobs or os.cpu_count() or 1, mp_context=get_context("spawn")) as pool:
                for results in pool.map(_compile_job, work):
                    yield from results
        finally:
            if previous is None:
                os.environ.pop("TRITON_CACHE_DIR", None)
            else:
                os.environ["TRITON_CACHE_DIR"] = previous


def _compile_job(job: tuple[str, str, tuple[str, ...]]) -> list[Compiled]:
    return compile_family(*job)
