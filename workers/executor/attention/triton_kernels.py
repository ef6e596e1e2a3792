"""Triton kernels for attention over the paged KV cache, reading K/V in place through block tables.

The cache of one layer, viewed as ``[slots, kv_heads, head_dim]`` (slot = block * block_size + offset), is read a
tile of ``BLOCK_N`` positions at a time: each position's block id comes from the sequence's row of the block
table, so no kernel ever gathers a sequence's blocks into a contiguous copy.

* Decode (one query token per sequence) is split along the context (flash-decoding): program
  ``(sequence, kv_head, split)`` attends the ``group`` query heads that share one KV head over one slice of the
  context and writes a partial output and its log-sum-exp; ``_decode_reduce_kernel`` merges the slices. The
  split size is read from device memory, so one launch shape (the one a CUDA graph captured) serves any context:
  the host sets it per step so the splits cover the longest context in the batch.
* Prefill (a chunk of new tokens after ``start_pos`` cached ones) tiles each chunk's queries by ``BLOCK_M`` rows;
  program ``(tile, head)`` runs causal flash attention over positions ``0 .. last query of the tile``.

Both run under ``TRITON_INTERPRET=1`` on CPU tensors, which is how CI tests them; ``bench/gpu.py --compile-only``
compiles them for sm_80 and sm_90 without a GPU.

Triton compiles a variant per specialisation of the arguments (an integer equal to 1 or divisible by 16, a
pointer aligned to 16 bytes). The ones that change from step to step are kept out of it (``do_not_specialize``,
``do_not_specialize_on_alignment``): the split count, a block table's width, and the metadata tensors, which sit
at step-dependent offsets of their staging buffers. Otherwise a GPU would compile again mid-serving, 0.5-2 s with
every stream stalled; specialising them would buy nothing, since each is read once per program or per tile. The
strides and head counts, fixed per model, stay specialised (tests/workers/test_triton_specialization.py).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _attend_tile(q, k_cache_ptr, v_cache_ptr, table_row, t, t_mask, visible, kv_head, d, d_mask, m_i, l_i, acc,
                 scale, stride_cache_slot, stride_cache_head, BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    """Fold positions ``t`` of one sequence (found through its block-table row) into the running softmax of the
    query rows ``q``; ``visible`` masks the scores. Returns the new (running max, running sum, accumulator)."""
    block = tl.load(table_row + t // BLOCK_SIZE, mask=t_mask, other=0)
    slot = block.to(tl.int64) * BLOCK_SIZE + t % BLOCK_SIZE
    kv_off = slot[:, None] * stride_cache_slot + kv_head * stride_cache_head + d[None, :]
    kv_mask = t_mask[:, None] & d_mask[None, :]
    k = tl.load(k_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    v = tl.load(v_cache_ptr + kv_off, mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, 1), acc


@triton.jit(do_not_specialize=["num_splits", "stride_table_row"],
            do_not_specialize_on_alignment=["tables_ptr", "seq_lens_ptr", "split_size_ptr"])
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, tables_ptr, seq_lens_ptr, split_size_ptr, part_out_ptr, part_lse_ptr,
    scale, num_heads, num_splits,
    stride_q_tok, stride_q_head, stride_cache_slot, stride_cache_head, stride_table_row,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_size = tl.load(split_size_ptr)
    start = split * split_size
    if start < seq_len:
        end = tl.minimum(start + split_size, seq_len)
        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, BLOCK_D)
        heads = kv_head * GROUP + g
        g_mask = g < GROUP
        d_mask = d < HEAD_DIM
        q = tl.load(q_ptr + seq.to(tl.int64) * stride_q_tok + heads[:, None] * stride_q_head + d[None, :],
                    mask=g_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
        table_row = tables_ptr + seq.to(tl.int64) * stride_table_row
        for tile in range(start, end, BLOCK_N):
            t = tile + tl.arange(0, BLOCK_N)
            t_mask = t < end
            m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table_row, t, t_mask, t_mask[None, :], kv_head,
                                         d, d_mask, m_i, l_i, acc, scale, stride_cache_slot, stride_cache_head,
                                         BLOCK_SIZE, PRECISION)
        part = (seq * num_heads + heads).to(tl.int64) * num_splits + split
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :], acc / l_i[:, None],
                 mask=g_mask[:, None] & d_mask[None, :])
        tl.store(part_lse_ptr + part, m_i + tl.log(l_i), mask=g_mask)


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["seq_lens_ptr", "split_size_ptr"])
def _decode_reduce_kernel(
    part_out_ptr, part_lse_ptr, seq_lens_ptr, split_size_ptr, out_ptr,
    num_heads, num_splits, stride_out_tok,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_size = tl.load(split_size_ptr)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < (seq_len + split_size - 1) // split_size  # the splits that held part of the context
    part = (seq * num_heads + head).to(tl.int64) * num_splits + s
    lse = tl.load(part_lse_ptr + part, mask=s_mask, other=float("-inf"))
    weight = tl.where(s_mask, tl.exp(lse - tl.max(lse, 0)), 0.0)
    parts = tl.load(part_out_ptr + part[:, None] * HEAD_DIM + d[None, :],
                    mask=s_mask[:, None] & (d < HEAD_DIM)[None, :], other=0.0)
    # A row with no context (a CUDA graph's padding) gets zeros, not NaN.
    o = tl.sum(parts * weight[:, None], 0) / tl.maximum(tl.sum(weight, 0), 1e-30)
    tl.store(out_ptr + seq.to(tl.int64) * stride_out_tok + head * HEAD_DIM + d, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit(do_not_specialize=["stride_table_row"],
            do_not_specialize_on_alignment=["tables_ptr", "tile_chunk_ptr", "tile_row_ptr", "chunk_row_ptr",
                                            "chunk_len_ptr", "chunk_start_ptr"])
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, tables_ptr,
    tile_chunk_ptr, tile_row_ptr, chunk_row_ptr, chunk_len_ptr, chunk_start_ptr,
    scale, stride_q_tok, stride_q_head, stride_out_tok, stride_cache_slot, stride_cache_head, stride_table_row,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP
    chunk = tl.load(tile_chunk_ptr + tile)
    row0 = tl.load(tile_row_ptr + tile)
    chunk_row = tl.load(chunk_row_ptr + chunk)
    chunk_len = tl.load(chunk_len_ptr + chunk)
    start_pos = tl.load(chunk_start_ptr + chunk)

    rows = row0 + tl.arange(0, BLOCK_M)
    r_mask = rows < chunk_row + chunk_len
    q_pos = start_pos + (rows - chunk_row)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + rows.to(tl.int64)[:, None] * stride_q_tok + head * stride_q_head + d[None, :],
                mask=r_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # Keys up to the tile's last query (causal): later positions are never read.
    end = tl.minimum(start_pos + chunk_len, start_pos + (row0 - chunk_row) + BLOCK_M)
    table_row = tables_ptr + chunk.to(tl.int64) * stride_table_row
    for tile_start in range(0, end, BLOCK_N):
        t = tile_start + tl.arange(0, BLOCK_N)
        t_mask = t < end
        visible = (t[None, :] <= q_pos[:, None]) & t_mask[None, :]
        m_i, l_i, acc = _attend_tile(q, k_cache_ptr, v_cache_ptr, table_row, t, t_mask, visible, kv_head, d, d_mask,
                                     m_i, l_i, acc, scale, stride_cache_slot, stride_cache_head, BLOCK_SIZE,
                                     PRECISION)
    o = acc / l_i[:, None]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_out_tok + head * HEAD_DIM + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=r_mask[:, None] & d_mask[None, :])
