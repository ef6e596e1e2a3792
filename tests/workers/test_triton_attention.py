"""The Triton paged-attention kernels against SDPA over gathered K/V.

Without a GPU they run under ``TRITON_INTERPRET=1`` on CPU tensors (set by this folder's conftest before Triton is
imported); on a CUDA machine the same tests run the compiled kernels on the GPU.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from switchyard.workers.executor.attention.triton_paged import (  # noqa: E402
    TritonAttention,
    num_decode_splits,
    split_size,
)
from tests.support.triton_devices import NOT_INTERPRETED, interpreted  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETED = DEVICE.type == "cpu"
if INTERPRETED and not interpreted():
    pytest.skip(NOT_INTERPRETED, allow_module_level=True)


def reference(q, k_cache, v_cache, chunks, block_size):
    """Causal attention of each chunk's queries over its positions 0..start+n, K/V gathered slot by slot."""
    num_heads, d = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[2]
    k_slots, v_slots = k_cache.view(-1, kv_heads, d), v_cache.view(-1, kv_heads, d)
    outs, row = [], 0
    for start, n, table in chunks:
        positions = torch.arange(start + n)
        slots = torch.tensor(table, device=q.device)[positions // block_size] * block_size + positions % block_size
        ks = k_slots[slots.to(q.device)].float().repeat_interleave(num_heads // kv_heads, dim=1)
        vs = v_slots[slots.to(q.device)].float().repeat_interleave(num_heads // kv_heads, dim=1)
        mask = torch.arange(start + n)[None, :] <= torch.arange(start, start + n)[:, None]
        o = F.scaled_dot_product_attention(q[row:row + n].float().transpose(0, 1), ks.transpose(0, 1),
                                           vs.transpose(0, 1), attn_mask=mask.to(q.device))
        outs.append(o.transpose(0, 1).reshape(n, -1))
        row += n
    return torch.cat(outs)


def make_case(rng, shapes, num_heads, kv_heads, d, block_size, dtype):
    """Random caches, with each chunk's blocks scattered over the pool; ``shapes`` = [(start_pos, num_tokens)]."""
    need = [-(-(start + n) // block_size) for start, n in shapes]
    num_blocks = sum(need) + 3
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    chunks, used = [], 0
    for (start, n), nb in zip(shapes, need):
        chunks.append((start, n, pool[used:used + nb]))
        used += nb
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    cache_shape = (num_blocks, block_size, kv_heads, d)
    k_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(DEVICE, dtype)
    total = sum(n for _, n in shapes)
    q = torch.randn(total, num_heads, d, generator=gen).to(DEVICE, dtype)
    k = torch.randn(total, kv_heads, d, generator=gen).to(DEVICE, dtype)
    v = torch.randn(total, kv_heads, d, generator=gen).to(DEVICE, dtype)
    return chunks, q, k, v, k_cache, v_cache


def run_case(seed, shapes, num_heads, kv_heads, d, block_size, dtype=torch.float32):
    rng = random.Random(seed)
    chunks, q, k, v, k_cache, v_cache = make_case(rng, shapes, num_heads, kv_heads, d, block_size, dtype)
    attention = TritonAttention(num_heads, kv_heads, d, block_size, DEVICE, dtype)
    meta = attention.prepare(chunks)
    out = attention.forward(q, k, v, k_cache, v_cache, meta)
    # forward wrote the new K/V into the cache: the reference reads them from there too
    expected = reference(q, k_cache, v_cache, chunks, block_size)
    return out.float(), expected


def relative_error(out, expected):
    return float((out - expected).norm() / expected.norm())


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_heads,kv_heads", [(4, 4), (8, 2), (6, 1)])
def test_prefill_and_decode_in_one_step_match_sdpa(block_size, num_heads, kv_heads):
    # ragged prefills (one from scratch, one after a cached prefix that ends mid-block), then decodes
    shapes = [(0, 37), (21, 70), (0, 2), (5, 1), (80, 1), (130, 1), (15, 1)]
    out, expected = run_case(block_size * 7 + num_heads, shapes, num_heads, kv_heads, 32, block_size)
    assert torch.isfinite(out).all()
    assert relative_error(out, expected) < 1e-4


def test_decodes_split_over_a_long_context_merge_exactly():
    shapes = [(700, 1), (3, 1), (256, 1)]
    out, expected = run_case(3, shapes, 4, 2, 16, 16)
    assert relative_error(out, expected) < 1e-4


def test_head_size_that_is_not_a_power_of_two():
    out, expected = run_case(4, [(10, 20), (40, 1)], 2, 1, 24, 16)
    assert relative_error(out, expected) < 1e-4


@pytest.mark.parametrize("dtype", [
    pytest.param(torch.bfloat16, marks=pytest.mark.skipif(
        INTERPRETED, reason="Triton's interpreter multiplies bf16 tl.dot operands as integers (3.9); GPU only")),
    torch.float16,
])
def test_half_precision_caches(dtype):
    out, expected = run_case(5, [(16, 40), (33, 1), (64, 1)], 4, 2, 32, 16, dtype)
    assert relative_error(out, expected) < 2e-2


def test_decode_split_sizes_cover_the_context():
    for num_seqs, context in [(1, 8192), (1, 17), (64, 2048), (3, 700)]:
        splits = num_decode_splits(num_seqs, 8, context, 132)
        assert 1 <= splits
        assert split_size(context, splits, 16) * splits >= context
        assert split_size(context, splits, 16) % 16 == 0
    assert num_decode_splits(1, 8, 8192, 132) > 1  # one sequence alone still fills the GPU
    assert num_decode_splits(64, 8, 2048, 132) == 1


def test_rows_of_a_padded_batch_with_no_context_give_zeros():
    """A CUDA graph pads the batch with rows of length 0: they must not put NaN anywhere."""
    rng = random.Random(6)
    chunks, q, k, v, k_cache, v_cache = make_case(rng, [(9, 1), (0, 1)], 4, 2, 16, 16, torch.float32)
    attention = TritonAttention(4, 2, 16, 16, DEVICE)
    meta = attention.prepare(chunks)
    meta.decode.seq_lens[1] = 0
    out = attention.forward(q, k, v, k_cache, v_cache, meta)
    assert torch.isfinite(out).all()
    assert out[1].abs().max() == 0


class _Launch:
    """Stands in for a Triton kernel: ``kernel[grid](...)`` runs ``body``."""

    def __init__(self, body):
        self.body = body

    def __getitem__(self, grid):
        return self.body


def test_the_start_up_check_passes_working_kernels_and_names_what_fails(monkeypatch):
    """An import proves nothing about a kernel: the backend is chosen only after its kernels ran once at the
    model's shapes and agreed with plain attention (else the engine falls back to SDPA and logs why)."""
    from switchyard.workers.executor import attention as backends
    from switchyard.workers.executor.attention import triton_kernels
    from switchyard.workers.executor.attention.triton_paged import probe

    working, reason = backends._working_triton(8, 2, 16, 16, DEVICE, torch.float32)
    assert working is not None and working.name == "triton" and "passed" in reason
    assert probe(TritonAttention(4, 4, 32, 4, DEVICE, torch.float32), torch.float32) is None

    def no_compiler(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(triton_kernels, "_decode_split_kernel", _Launch(no_compiler))
    working, reason = backends._working_triton(8, 2, 16, 16, DEVICE, torch.float32)
    assert working is None and "RuntimeError: PTX assembly failed" in reason
    monkeypatch.undo()

    monkeypatch.setattr(triton_kernels, "_decode_reduce_kernel", _Launch(lambda *args, **kwargs: None))
    assert "differs from plain attention" in probe(TritonAttention(8, 2, 16, 16, DEVICE, torch.float32),
                                                   torch.float32)
