"""Paged attention with Triton kernels (``triton_kernels``): the CUDA default, for any block size.

One launch covers all of a step's prefill chunks (ragged, each after its own cached prefix) and two cover all its
decodes (split-context attention, then the merge of the splits). Nothing is gathered: every kernel reads the cache
in place through the block tables, so the only KV memory is the cache itself.

Decode metadata comes in two forms: built fresh per step (``prepare``), or written into the fixed buffers that a
CUDA graph captured (``DecodeBuffers``, see ``executor.cuda_graphs``); the kernels read both the same way.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from switchyard.workers.executor.attention.base import AttentionMetadata, ChunkShape, HeadLayout, plan_slots, write_kv
from switchyard.workers.executor.transfers import to_device

PREFILL_BLOCK_M = 64  # query rows per prefill program
PREFILL_BLOCK_N = 64  # key positions per inner-loop tile
DECODE_BLOCK_N = 64
MAX_SPLITS = 32  # also the merge kernel's fixed width, so that one compiled variant serves every split count
MIN_SPLIT = 64  # fewer context positions than this per split are not worth a partial result


def triton_available() -> bool:
    """Whether Triton imports (``probe`` says whether its kernels work on a device)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


_PROBE_SEEDS = itertools.count()


def probe(attention: TritonAttention, dtype: torch.dtype) -> str | None:
    """Compile and run this backend's kernels once, at its shapes, on a two-step case (a 5-token prefill over two
    blocks, then a decode) and compare them with plain attention; None when they agree, else why not.

    An import proves little: a Triton without a backend for this GPU, a missing ptxas or a kernel the compiler
    rejects at these shapes only show at the first launch, which would be the first request's step. This also
    leaves the kernels compiled for that step."""
    heads, kv_heads, d, bs = attention.num_heads, attention.num_kv_heads, attention.head_dim, attention.block_size
    n = 5
    num_blocks = -(-(n + 1) // bs) + 1
    table = list(range(num_blocks - 1, -1, -1))  # blocks out of order, as a real table may be
    # Inputs of their own each time: a kernel that writes nothing leaves its output buffer as the allocator gave
    # it, which may be an earlier probe's freed output, and right for that probe's inputs.
    gen = torch.Generator().manual_seed(next(_PROBE_SEEDS))
    q, k, v = (torch.randn(n + 1, h, d, generator=gen).to(attention.device, dtype) for h in (heads, kv_heads, kv_heads))
    k_cache = torch.zeros(num_blocks, bs, kv_heads, d, device=attention.device, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    try:
        out = torch.cat([
            attention.forward(q[:n], k[:n], v[:n], k_cache, v_cache, attention.prepare([(0, n, table)])),
            attention.forward(q[n:], k[n:], v[n:], k_cache, v_cache, attention.prepare([(n, 1, table)])),
        ]).float()
    except Exception as exc:  # whatever the compiler or driver raises: the reason is what the log needs
        return f"{type(exc).__name__}: {exc}"
    causal = torch.ones(n + 1, n + 1, dtype=torch.bool, device=attention.device).tril()
    expected = F.scaled_dot_product_attention(
        q.float().transpose(0, 1), k.float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1),
        v.float().repeat_interleave(heads // kv_heads, 1).transpose(0, 1), attn_mask=causal,
    ).transpose(0, 1).reshape(n + 1, heads * d)
    error = (out - expected).abs().max().item()
    tolerance = 1e-3 if dtype == torch.float32 else 5e-2
    if not error <= tolerance:  # NaN fails too
        return f"the kernels' output differs from plain attention by {error:.3g} (tolerance {tolerance})"
    return None


def next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def num_decode_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """How many slices each decode's context is cut into: enough programs for about two per multiprocessor,
    never slices shorter than ``MIN_SPLIT`` positions."""
    wanted = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(wanted, MAX_SPLITS, -(-max_context // MIN_SPLIT)))


def split_size(max_context: int, num_splits: int, block_size: int) -> int:
    """Positions per split so that ``num_splits`` of them cover ``max_context``, a whole number of blocks."""
    per_split = -(-max_context // num_splits)
    return -(-per_split // block_size) * block_size


@dataclass(slots=True)
class DecodeBatch:
    """What the decode kernels read for ``num_seqs`` one-token rows (the step's last rows)."""

    num_seqs: int
    tables: torch.Tensor  # [B, max_blocks] long
    seq_lens: torch.Tensor  # [B] long: context length including the new token
    split_size: torch.Tensor  # [1] long, on the device so that a captured graph reads this step's value
    num_splits: int
    part_out: torch.Tensor  # [B * heads * num_splits, head_dim] fp32 scratch
    part_lse: torch.Tensor  # [B * heads * num_splits] fp32 scratch


@dataclass(slots=True)
class PrefillBatch:
    """The step's multi-token chunks: one prefill program per (tile of ``PREFILL_BLOCK_M`` rows, head)."""

    num_tiles: int
    tables: torch.Tensor  # [P, max_blocks] long
    tile_chunk: torch.Tensor  # [tiles] int32: the chunk of each tile
    tile_row: torch.Tensor  # [tiles] int32: the tile's first row in the step
    chunk_row: torch.Tensor  # [P] int32: each chunk's first row
    chunk_len: torch.Tensor  # [P] int32
    chunk_start: torch.Tensor  # [P] int32: tokens already cached before the chunk


@dataclass(slots=True)
class TritonMetadata(AttentionMetadata):
    prefill: PrefillBatch | None
    decode: DecodeBatch | None


class TritonAttention(HeadLayout):
    """See the module docstring."""

    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
                 dtype: torch.dtype = torch.float32):
        from switchyard.workers.executor.attention import triton_kernels

        super().__init__(num_heads, num_kv_heads, head_dim, block_size, device)
        self.kernels = triton_kernels
        # fp32 dots in full precision (Triton would take tf32), so fp32 output matches fp32 references.
        self.precision = "ieee" if dtype == torch.float32 else "tf32"
        self.num_sms = (torch.cuda.get_device_properties(device).multi_processor_count
                        if device.type == "cuda" else 4)

    def decode_batch(self, num_seqs: int, tables: torch.Tensor, seq_lens: torch.Tensor, split: torch.Tensor,
                     num_splits: int) -> DecodeBatch:
        rows = num_seqs * self.num_heads * num_splits
        return DecodeBatch(num_seqs, tables, seq_lens, split, num_splits,
                           torch.empty(rows, self.head_dim, dtype=torch.float32, device=self.device),
                           torch.empty(rows, dtype=torch.float32, device=self.device))

    def prepare(self, chunks: Sequence[ChunkShape]) -> TritonMetadata:
        plan = plan_slots(chunks, self.block_size, self.device)
        num_prefills = sum(1 for _, n, _ in chunks if n > 1)
        prefill = decode = None
        if num_prefills:
            tile_chunk, tile_row, chunk_row, row = [], [], [], 0
            for i, (_, n, _) in enumerate(chunks[:num_prefills]):
                chunk_row.append(row)
                for first in range(row, row + n, PREFILL_BLOCK_M):
                    tile_chunk.append(i)
                    tile_row.append(first)
                row += n
            ints = to_device([tile_chunk, tile_row], torch.int32, self.device)
            per_chunk = to_device([chunk_row, [n for _, n, _ in chunks[:num_prefills]],
                                   [start for start, _, _ in chunks[:num_prefills]]], torch.int32, self.device)
            prefill = PrefillBatch(len(tile_chunk), plan.tables[:num_prefills], ints[0], ints[1], *per_chunk)
        if num_prefills < len(chunks):
            decodes = chunks[num_prefills:]
            max_context = max(start + 1 for start, _, _ in decodes)
            num_splits = num_decode_splits(len(decodes), self.num_kv_heads, max_context, self.num_sms)
            size = split_size(max_context, num_splits, self.block_size)
            lens_and_split = to_device([*(start + 1 for start, _, _ in decodes), size], torch.long, self.device)
            decode = self.decode_batch(len(decodes), plan.tables[num_prefills:], lens_and_split[:-1],
                                       lens_and_split[-1:], num_splits)
        return TritonMetadata(plan.positions, plan.slot_mapping, plan.num_prefill_tokens, prefill, decode)

    def forward(self, q, k, v, k_cache, v_cache, meta: TritonMetadata) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` (rotary applied) -> attention output ``[T, heads * d]``."""
        write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        k_slots = k_cache.view(-1, self.num_kv_heads, self.head_dim)
        v_slots = v_cache.view(-1, self.num_kv_heads, self.head_dim)
        if meta.prefill is not None:
            self._prefill(q, k_slots, v_slots, out, meta.prefill)
        if meta.decode is not None:
            rows = slice(meta.num_prefill_tokens, None)
            self._decode(q[rows], k_slots, v_slots, out[rows], meta.decode)
        return out

    def _prefill(self, q, k_slots, v_slots, out, batch: PrefillBatch) -> None:
        d = self.head_dim
        self.kernels._prefill_kernel[(batch.num_tiles, self.num_heads)](
            q, k_slots, v_slots, out, batch.tables,
            batch.tile_chunk, batch.tile_row, batch.chunk_row, batch.chunk_len, batch.chunk_start,
            self.scale, q.stride(0), q.stride(1), out.stride(0), k_slots.stride(0), k_slots.stride(1),
            batch.tables.stride(0),
            GROUP=self.group, HEAD_DIM=d, BLOCK_D=next_power_of_2(d), BLOCK_SIZE=self.block_size,
            BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=PREFILL_BLOCK_N, PRECISION=self.precision,
            num_warps=4 if d <= 64 else 8,
        )

    def _decode(self, q, k_slots, v_slots, out, batch: DecodeBatch) -> None:
        d = self.head_dim
        self.kernels._decode_split_kernel[(batch.num_seqs, self.num_kv_heads, batch.num_splits)](
            q, k_slots, v_slots, batch.tables, batch.seq_lens, batch.split_size, batch.part_out, batch.part_lse,
            self.scale, self.num_heads, batch.num_splits,
            q.stride(0), q.stride(1), k_slots.stride(0), k_slots.stride(1), batch.tables.stride(0),
            GROUP=self.group, GROUP_PAD=max(16, next_power_of_2(self.group)), HEAD_DIM=d,
            BLOCK_D=next_power_of_2(d), BLOCK_SIZE=self.block_size, BLOCK_N=DECODE_BLOCK_N,
            PRECISION=self.precision, num_warps=4,
        )
        self.kernels._decode_reduce_kernel[(batch.num_seqs, self.num_heads)](
            batch.part_out, batch.part_lse, batch.seq_lens, batch.split_size, out,
            self.num_heads, batch.num_splits, out.stride(0),
            HEAD_DIM=d, BLOCK_D=next_power_of_2(d), SPLITS_PAD=MAX_SPLITS, num_warps=4,
        )
