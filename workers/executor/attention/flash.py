"""flash-attn's varlen kernel over the paged cache (CUDA, only when ``flash_attn`` imports).

One ``flash_attn_varlen_func`` call per layer covers the whole mixed batch, reading the paged cache through
``block_table``. flash-attn 2 only accepts paged caches whose block size is a multiple of 256, so with smaller
blocks ``make_attention`` keeps another backend. flash-attn applies the causal mask aligned to the bottom right
when a sequence has fewer queries than keys, which is exactly "query i sees positions <= start_pos + i".
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from switchyard.workers.executor.attention.base import AttentionMetadata, ChunkShape, HeadLayout, plan_slots, write_kv

FLASH_BLOCK_MULTIPLE = 256  # flash-attn 2 paged KV: "Paged KV cache block size must be divisible by 256"


def flash_attn_varlen():
    """``flash_attn.flash_attn_varlen_func``, or None where flash-attn is not installed (or built for another
    torch/CUDA)."""
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception:
        return None
    return flash_attn_varlen_func


@dataclass(slots=True)
class FlashMetadata(AttentionMetadata):
    cu_seqlens_q: torch.Tensor  # [C + 1] int32, query rows of each chunk
    cu_seqlens_k: torch.Tensor  # [C + 1] int32, keys (cached + new) of each chunk
    max_seqlen_q: int
    max_seqlen_k: int
    block_table: torch.Tensor  # [C, max_blocks] int32


class FlashAttention(HeadLayout):
    """See the module docstring."""

    name = "flash"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device):
        if block_size % FLASH_BLOCK_MULTIPLE:
            raise ValueError(f"flash-attn paged KV needs block_size % {FLASH_BLOCK_MULTIPLE} == 0, got {block_size}")
        self.varlen = flash_attn_varlen()
        if self.varlen is None:
            raise RuntimeError("flash_attn is not importable")
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, device)

    def prepare(self, chunks: Sequence[ChunkShape]) -> FlashMetadata:
        plan = plan_slots(chunks, self.block_size, self.device)
        q_lens = [n for _, n, _ in chunks]
        k_lens = [start + n for start, n, _ in chunks]
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32).to(self.device)
        cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32).to(self.device)
        return FlashMetadata(plan.positions, plan.slot_mapping, plan.num_prefill_tokens, cu_q, cu_k, max(q_lens),
                             max(k_lens), plan.tables.to(torch.int32))

    def forward(self, q, k, v, k_cache, v_cache, meta: FlashMetadata) -> torch.Tensor:
        write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        o = self.varlen(
            q, k_cache, v_cache, meta.cu_seqlens_q, meta.cu_seqlens_k, meta.max_seqlen_q, meta.max_seqlen_k,
            softmax_scale=self.scale, causal=True, block_table=meta.block_table,
        )
        return o.reshape(q.shape[0], -1)
