"""The compiled CPU attention kernels (decode and prefill) against the SDPA backend, and the fallback when they
cannot be built."""

from __future__ import annotations

import random

import pytest
import torch

from switchyard.workers.executor import kernels
from switchyard.workers.executor.attention import SdpaAttention, make_attention
from switchyard.workers.executor.attention.cpu_paged import CpuPagedAttention, load_kernel
from switchyard.workers.executor.kernels import load_library

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(compiled):
    return compiled(load_kernel, "csrc/paged_decode.c")


def _step(heads, kv_heads, head_dim, block_size, decode_contexts, prefill=(0, 0), seed=0):
    """Random cache, q/k/v and chunk shapes (an optional prefill chunk first, then decodes) over shuffled blocks."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + 1) // block_size) for c in (*decode_contexts, sum(prefill))) + 2
    free = list(range(1, num_blocks))
    rng.shuffle(free)

    def table(num_tokens):
        return [free.pop() for _ in range(-(-num_tokens // block_size))]

    chunks = []
    if prefill[1]:
        chunks.append((prefill[0], prefill[1], table(sum(prefill))))
    chunks += [(c, 1, table(c + 1)) for c in decode_contexts]
    num_tokens = sum(n for _, n, _ in chunks)
    cache = [torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen) for _ in range(2)]
    # q as the runner makes it: a view of a wider [T, heads + kv_heads, d] tensor (rows not contiguous).
    q = torch.randn(num_tokens, heads + kv_heads, head_dim, generator=gen)[:, :heads]
    k, v = (torch.randn(num_tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    return chunks, cache, q, k, v


def _attend(backend_cls, shape, step, dtype=torch.float32):
    chunks, (k_cache, v_cache), q, k, v = step
    attention = backend_cls(*shape, CPU) if dtype == torch.float32 else backend_cls(*shape, CPU, dtype)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    out = attention.forward(q, k, v, k_cache, v_cache, attention.prepare(chunks))
    return out, k_cache, v_cache


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [
    (9, 3, 64, 16),   # SmolLM2: grouped-query attention, head_dim 64
    (8, 8, 128, 16),  # multi-head, head_dim 128
    (6, 2, 32, 4),    # a head_dim the kernel has no special case for, tiny blocks
    (4, 1, 16, 8),    # multi-query
])
def test_kernel_matches_sdpa_on_mixed_steps(kernel, heads, kv_heads, head_dim, block_size):
    shape = (heads, kv_heads, head_dim, block_size)
    contexts = [0, 1, block_size - 1, block_size, 3 * block_size + 5, 97, 300, 11]
    step = _step(*shape, contexts, prefill=(2 * block_size + 3, 7))
    expected, k_ref, v_ref = _attend(SdpaAttention, shape, step)
    got, k_got, v_got = _attend(CpuPagedAttention, shape, step)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(k_got, k_ref) and torch.equal(v_got, v_ref)  # the step's K/V written to the same slots


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 16, 8)])
@pytest.mark.parametrize("start,num_tokens", [
    (0, 2),     # a fresh two-token prompt
    (0, 37),    # fresh, over query tiles of 16 and key panels of 16 with remainders
    (45, 33),   # a later chunk: its keys start at position 0, in the cache
    (5, 200),
])
def test_prefill_kernel_matches_sdpa(kernel, heads, kv_heads, head_dim, block_size, start, num_tokens):
    shape = (heads, kv_heads, head_dim, block_size)
    assert CpuPagedAttention(*shape, CPU)._prefill_lib is not None  # the compiled path, not the SDPA fallback
    step = _step(*shape, [50, 3], prefill=(start, num_tokens), seed=start + num_tokens)
    expected, _, _ = _attend(SdpaAttention, shape, step)
    got, _, _ = _attend(CpuPagedAttention, shape, step)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_kernel_decode_only_step_and_threads(kernel):
    shape = (9, 3, 64, 16)
    step = _step(*shape, [random.Random(3).randint(1, 600) for _ in range(33)], seed=3)
    expected, _, _ = _attend(SdpaAttention, shape, step)
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            got, _, _ = _attend(CpuPagedAttention, shape, step)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 8, 128, 16), (6, 2, 32, 4)])
def test_bf16_decodes_match_fp32_attention_over_the_same_values(kernel, heads, kv_heads, head_dim, block_size):
    """bf16 caches: the decode kernel widens each row and computes in fp32, so it must equal fp32 attention over
    the same (bf16) values up to the output's rounding; the step's prefill chunk goes through SDPA."""
    shape = (heads, kv_heads, head_dim, block_size)
    chunks, cache, q, k, v = _step(*shape, [0, 1, block_size, 3 * block_size + 5, 300, 11],
                                   prefill=(block_size + 3, 9), seed=5)
    bf16 = [t.to(torch.bfloat16) for t in (*cache, q, k, v)]
    reference = (chunks, [t.float() for t in bf16[:2]], *(t.float() for t in bf16[2:]))
    expected, k_ref, v_ref = _attend(SdpaAttention, shape, reference)
    assert CpuPagedAttention(*shape, CPU, torch.bfloat16)._prefill_lib is None
    got, k_got, v_got = _attend(CpuPagedAttention, shape, (chunks, bf16[:2], *bf16[2:]), torch.bfloat16)
    assert got.dtype == torch.bfloat16
    num_prefill = 9
    # Decodes: one rounding of an fp32 result (bf16 keeps 8 bits); the prefill rows went through bf16 SDPA.
    torch.testing.assert_close(got[num_prefill:].float(), expected[num_prefill:], atol=1e-2, rtol=2**-8)
    torch.testing.assert_close(got[:num_prefill].float(), expected[:num_prefill], atol=3e-2, rtol=3e-2)
    assert torch.equal(k_got.float(), k_ref) and torch.equal(v_got.float(), v_ref)


def test_default_backend_on_cpu(kernel):
    assert isinstance(make_attention(9, 3, 64, 16, CPU), CpuPagedAttention)  # fp32 cache: the kernels
    bf16 = make_attention(9, 3, 64, 16, CPU, dtype=torch.bfloat16)
    assert isinstance(bf16, CpuPagedAttention) and bf16._prefill_lib is None  # bf16: decodes only
    assert type(make_attention(9, 3, 64, 16, CPU, dtype=torch.float16)) is SdpaAttention


def test_no_compiler_falls_back_to_sdpa(no_compiler, caplog):
    assert load_kernel() is None
    assert type(make_attention(9, 3, 64, 16, CPU)) is SdpaAttention
    assert "paged_decode.c" in caplog.text
    assert not list(no_compiler.glob("*.so*"))  # a failed build leaves no file behind


def test_kernel_is_built_once_per_cache(monkeypatch, tmp_path, kernel, no_installed_build):
    monkeypatch.setenv("SWITCHYARD_KERNEL_CACHE", str(tmp_path))
    assert load_kernel() is not None
    built = list(tmp_path.glob("paged_decode-*.so"))
    assert len(built) == 1
    mtime = built[0].stat().st_mtime_ns
    load_library.cache_clear()
    assert load_kernel() is not None
    assert built[0].stat().st_mtime_ns == mtime  # reused, not rebuilt


def test_the_install_built_every_kernel_for_this_machine(kernel):
    # `pip install` (setup.py) builds them where a compiler is present, as `kernel` showed one is.
    assert all(kernels.installed_library(name) is not None for name in kernels.KERNELS)


def test_loading_the_kernels_leaves_the_process_floating_point_mode_alone(kernel):
    """Fast math is for the kernels' own loops: linked with -ffast-math, a library turns on flush-to-zero for the
    whole process as it loads, and torch's and Python's subnormals silently become zero. A fresh process, as the
    test process may have loaded a build already."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from switchyard.workers.executor import kernels\n"
        "assert all(kernels.load_library(n) is not None for n in kernels.KERNELS)\n"
        "tiny = 5e-324\n"
        "assert tiny * 1.0 > 0, 'Python floats flushed to zero'\n"
        "t = torch.tensor([1e-40], dtype=torch.float32)\n"
        "assert (t * 1.0).item() > 0, 'torch subnormals flushed to zero'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_an_install_built_for_another_cpu_is_not_loaded(monkeypatch, kernel, caplog):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags : sse2")
    assert kernels.installed_library("paged_decode") is None
    assert "another source or for another CPU" in caplog.text


def test_infinite_scores_get_no_weight_as_in_sdpa(kernel):
    # Built with fast math (which assumes no infinities), the kernels must still give a key whose score overflows
    # to -inf no weight, as SDPA does. Key 0 of each decode is huge and opposite to its query: its score is -inf.
    shape = (4, 2, 16, 4)
    chunks, (k_cache, v_cache), q, k, v = _step(*shape, decode_contexts=[5, 9], prefill=(0, 6), seed=3)
    heads, kv_heads = shape[0], shape[1]
    group = heads // kv_heads
    row = chunks[0][1]  # decodes follow the prefill's rows
    for _start, _n, table in chunks[1:]:
        for h in range(kv_heads):
            q[row, h * group : (h + 1) * group] = q[row, h * group]  # the group's heads ask the same question
            k_cache[table[0], 0, h] = -3e38 * torch.sign(q[row, h * group])
        row += 1
    step = (chunks, (k_cache, v_cache), q, k, v)
    got, _, _ = _attend(CpuPagedAttention, shape, step)
    want, _, _ = _attend(SdpaAttention, shape, step)
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """K or V ``[T, kv_heads, d]`` (float32) as an int8 cache stores them: ``[T, kv_heads, d + 4]`` int8, each row's
    values rounded half away from zero to ``x / scale`` with ``scale = max|row| / 127``, then ``scale``'s four bytes.
    The reference of ``csrc/paged_decode.c``'s ``write_kv_i8``."""
    peak = x.float().abs().amax(-1, keepdim=True)
    q = x * torch.where(peak > 0, 127 / peak, 0)
    rows = torch.empty(*x.shape[:-1], x.shape[-1] + 4, dtype=torch.int8)
    rows[..., : x.shape[-1]] = torch.where(q < 0, q - 0.5, q + 0.5).trunc()
    rows[..., x.shape[-1] :] = (peak * (1 / 127)).view(torch.int8)
    return rows


def int8_values(rows: torch.Tensor) -> torch.Tensor:
    """What int8 cache rows (``int8_rows``) hold, as float32: ``[..., d + 4]`` -> ``[..., d]``."""
    return rows[..., :-4].float() * rows[..., -4:].contiguous().view(torch.float32)


def _int8_step(shape, contexts, prefill, seed):
    """A random step (``_step``) with int8 caches, and the same step in float32 (for the error bound)."""
    chunks, cache, q, k, v = _step(*shape, contexts, prefill=prefill, seed=seed)
    return (chunks, [int8_rows(c) for c in cache], q, k, v), (chunks, cache, q, k, v)


def _attend_int8(shape, step):
    chunks, (k_cache, v_cache), q, k, v = step
    attention = CpuPagedAttention(*shape, CPU, kv_int8=True)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    return attention.forward(q, k, v, k_cache, v_cache, attention.prepare(chunks)), k_cache, v_cache


def _slots(chunks, block_size):
    return [table[p // block_size] * block_size + p % block_size for start, n, table in chunks
            for p in range(start, start + n)]


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 8, 128, 16), (4, 1, 16, 8)])
@pytest.mark.parametrize("prefill", [(0, 37), (45, 33)])
def test_int8_cache_attends_as_fp32_over_the_values_it_holds(kernel, heads, kv_heads, head_dim, block_size, prefill):
    """Both kernels widen each int8 row and compute in fp32: equal to fp32 attention over the values the cache holds
    (the step's new K/V as the kernel wrote them); and it wrote them as ``int8_rows`` quantizes them (within one
    step of rounding: the C code's division may differ from torch's in the last bit)."""
    shape = (heads, kv_heads, head_dim, block_size)
    step, _ = _int8_step(shape, [0, 1, block_size, 3 * block_size + 5, 300, 11], prefill, seed=sum(prefill))
    chunks, int8_cache, q, k, v = step
    got, k_got, v_got = _attend_int8(shape, step)
    slots = _slots(chunks, block_size)
    written = [c.view(-1, kv_heads, head_dim + 4)[slots] for c in (k_got, v_got)]
    held = (chunks, [int8_values(c) for c in int8_cache], q, *(int8_values(w) for w in written))
    expected, k_ref, v_ref = _attend(SdpaAttention, shape, held)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(int8_values(k_got), k_ref) and torch.equal(int8_values(v_got), v_ref)  # the same slots
    for rows, x in zip(written, (k, v)):
        reference = int8_rows(x)
        assert (rows[..., :head_dim].int() - reference[..., :head_dim].int()).abs().max() <= 1
        scales = [r[..., head_dim:].contiguous().view(torch.float32) for r in (rows, reference)]
        torch.testing.assert_close(*scales, atol=0, rtol=1e-6)


def test_int8_cache_stays_within_its_error_bound_of_fp32_attention(kernel):
    """The quantization error itself: one scale per row of 64 keeps attention outputs within 2% of fp32's (random
    rows: about 0.7%)."""
    shape = (9, 3, 64, 16)
    step, full = _int8_step(shape, [random.Random(4).randint(1, 600) for _ in range(16)], (0, 40), seed=4)
    expected, _, _ = _attend(CpuPagedAttention, shape, full)
    got, _, _ = _attend_int8(shape, step)
    error = (got - expected).norm(dim=-1) / expected.norm(dim=-1)
    assert error.max() < 0.02 and error.mean() < 0.01, error


def test_int8_cache_refuses_what_its_kernels_cannot_read(kernel):
    with pytest.raises(ValueError, match="with fp32"):
        CpuPagedAttention(9, 3, 64, 16, CPU, torch.bfloat16, kv_int8=True)
    with pytest.raises(ValueError, match="multiple of 16"):
        CpuPagedAttention(6, 2, 40, 16, CPU, kv_int8=True)  # the SDPA fallback cannot read int8 rows
    for backend in ("sdpa", "triton"):
        with pytest.raises(ValueError, match="cpu_paged"):
            make_attention(9, 3, 64, 16, CPU, backend, kv_cache_dtype="int8")
    assert make_attention(9, 3, 64, 16, CPU, kv_cache_dtype="int8").kv_int8
