"""Paged attention with torch SDPA: works on any device and is the fallback of every other backend.

All decodes share one call per layer (or a few, by context length): their KV blocks are gathered whole (one
``index_select`` of ``block_size``-token rows) into a padded ``[B, L, kv_heads, head_dim]`` tensor, and the query
heads that share a KV head are folded into the query-length axis (``[B, kv_heads, group, head_dim]``), which is
plain multi-query attention with no KV repetition and several times faster on CPU than ``enable_gqa=True``. Prefill
chunks get one call each, with a causal mask offset by the chunk's start position (query ``i`` sees positions
``<= start_pos + i``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from switchyard.workers.executor.attention.base import (
    AttentionMetadata,
    ChunkShape,
    HeadLayout,
    SlotPlan,
    plan_slots,
    write_kv,
)


@dataclass(slots=True)
class PrefillSpan:
    """One multi-token chunk of the step."""

    row: int  # first row of the chunk in the step's flat batch
    num_tokens: int
    start_pos: int  # tokens of the sequence already in the cache before this chunk
    table: torch.Tensor  # [blocks] long: the block ids covering positions [0, start_pos + num_tokens)
    mask: torch.Tensor | None  # [num_tokens, context] bool, True = attend; None when start_pos == 0 or not needed


def prefill_spans(plan: SlotPlan, chunks: Sequence[ChunkShape], with_masks: bool) -> list[PrefillSpan]:
    """The step's prefill chunks; ``with_masks``: the causal masks SDPA needs for chunks after a cached prefix."""
    spans, row = [], 0
    for i, (start, n, _) in enumerate(chunks):
        if n == 1:
            break  # decodes follow the prefills
        mask = None
        if with_masks and start > 0:
            key_pos = torch.arange(start + n, device=plan.positions.device)
            query_pos = torch.arange(start, start + n, device=plan.positions.device)
            mask = key_pos[None, :] <= query_pos[:, None]
        spans.append(PrefillSpan(row, n, start, plan.tables[i, : plan.num_blocks[i]], mask))
        row += n
    return spans


@dataclass(slots=True)
class DecodeGroup:
    """Decodes of similar context length, attended in one SDPA call."""

    rows: torch.Tensor  # [b] long, the group's rows among the step's decodes
    blocks: torch.Tensor  # [b, max_blocks] long, padded to the group's longest context only
    mask: torch.Tensor  # [b, 1, 1, max_blocks * block_size] bool, True = attend


@dataclass(slots=True)
class SdpaMetadata(AttentionMetadata):
    prefills: list[PrefillSpan]
    # Decodes split by context length, so a short sequence is not padded to the longest one's context.
    decode_groups: list[DecodeGroup]


class SdpaAttention(HeadLayout):
    """Paged attention with torch SDPA (see the module docstring)."""

    name = "sdpa"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, device)
        self.max_decode_groups = 4
        # Gather buffers reused by every layer and step (grown on demand): a fresh multi-MB tensor per layer
        # costs more in page faults than the copy itself.
        self._k_buf = torch.empty(0, device=device)
        self._v_buf = torch.empty(0, device=device)

    def _gather_buffers(self, num_blocks: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (num_blocks, *like.shape[1:])
        numel = math.prod(shape)
        if self._k_buf.numel() < numel or self._k_buf.dtype != like.dtype:
            self._k_buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._v_buf = torch.empty(numel, dtype=like.dtype, device=like.device)
        return self._k_buf[:numel].view(shape), self._v_buf[:numel].view(shape)

    def _gather(self, k_cache, v_cache, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy whole blocks (contiguous rows of block_size*kv_heads*head_dim) of both caches into the buffers."""
        k_out, v_out = self._gather_buffers(blocks.numel(), k_cache)
        torch.index_select(k_cache, 0, blocks, out=k_out)
        torch.index_select(v_cache, 0, blocks, out=v_out)
        return k_out, v_out

    def prepare(self, chunks: Sequence[ChunkShape]) -> SdpaMetadata:
        plan = plan_slots(chunks, self.block_size, self.device)
        prefills = prefill_spans(plan, chunks, with_masks=True)
        groups = []
        if len(prefills) < len(chunks):
            num_blocks = plan.num_blocks[len(prefills):]
            max_blocks = max(num_blocks)
            blocks = plan.tables[len(prefills):, :max_blocks]
            context = plan.positions[plan.num_prefill_tokens :] + 1  # decodes have one row each
            key_pos = torch.arange(max_blocks * self.block_size, device=self.device)
            mask = (key_pos[None, :] < context[:, None])[:, None, None, :]
            groups = self._decode_groups(num_blocks, blocks, mask)
        return SdpaMetadata(plan.positions, plan.slot_mapping, plan.num_prefill_tokens, prefills, groups)

    def _decode_groups(self, num_blocks: list[int], blocks: torch.Tensor, mask: torch.Tensor) -> list[DecodeGroup]:
        """Split decodes into up to ``max_decode_groups`` runs of similar length (sorted, equal counts).

        Padding every decode to the longest context wastes gather and attention work on mixed lengths; a few groups
        recover most of it while keeping the number of SDPA calls small.
        """
        num_groups = max(1, min(self.max_decode_groups, len(num_blocks) // 4))
        if num_groups == 1:  # in step order, so forward() may skip the gather/scatter of rows
            return [DecodeGroup(torch.arange(len(num_blocks), device=self.device), blocks, mask)]
        order = sorted(range(len(num_blocks)), key=num_blocks.__getitem__)
        size = -(-len(order) // num_groups)
        groups = []
        for start in range(0, len(order), size):
            members = order[start : start + size]
            width = num_blocks[members[-1]]  # sorted: the last is the longest
            rows = torch.tensor(members, dtype=torch.long, device=self.device)
            groups.append(DecodeGroup(rows, blocks[rows, :width], mask[rows][..., : width * self.block_size]))
        return groups

    def forward(self, q, k, v, k_cache, v_cache, meta: SdpaMetadata) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` (rotary applied) -> attention output ``[T, heads * d]``."""
        write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        outs = []
        for span in meta.prefills:
            rows = slice(span.row, span.row + span.num_tokens)
            outs.append(self.attend_prefill(span, q[rows], k[rows], v[rows], k_cache, v_cache))
        if meta.decode_groups:
            outs.append(self._attend_decodes(q[meta.num_prefill_tokens :], k_cache, v_cache, meta.decode_groups))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def attend_prefill(self, span: PrefillSpan, qs, ks, vs, k_cache, v_cache) -> torch.Tensor:
        """Causal attention of one prefill chunk (its span built ``with_masks``): q ``[n, heads, d]`` and the
        chunk's own k/v ``[n, kv_heads, d]`` (already in the cache) -> ``[n, heads * d]``."""
        kvh, d = self.num_kv_heads, self.head_dim
        if span.start_pos > 0:  # a later chunk: its keys start at position 0, in the cache
            assert span.mask is not None  # built with_masks: a chunk after a cached prefix has its causal mask
            ks, vs = self._gather(k_cache, v_cache, span.table)
            ks = ks.view(-1, kvh, d)[: span.mask.shape[1]]
            vs = vs.view(-1, kvh, d)[: span.mask.shape[1]]
        # 4-D inputs: CPU SDPA only takes its fused kernel for 4-D tensors (3-D falls back to bmm + softmax).
        o = F.scaled_dot_product_attention(
            qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None],
            attn_mask=span.mask, is_causal=span.mask is None, scale=self.scale, enable_gqa=True,
        )[0]
        return o.transpose(0, 1).reshape(span.num_tokens, -1)

    def _attend_decodes(self, q_dec, k_cache, v_cache, groups: list[DecodeGroup]) -> torch.Tensor:
        """Attention of the step's decodes ``q_dec [B, heads, d]`` -> ``[B, heads * d]``, one SDPA call a group."""
        if len(groups) == 1:
            return self._decode(q_dec, k_cache, v_cache, groups[0].blocks, groups[0].mask)
        out = q_dec.new_empty(q_dec.shape[0], q_dec.shape[1] * self.head_dim)
        for g in groups:
            out.index_copy_(0, g.rows, self._decode(q_dec.index_select(0, g.rows), k_cache, v_cache, g.blocks, g.mask))
        return out

    def _decode(self, q_dec, k_cache, v_cache, blocks: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One SDPA call for decodes ``q_dec [b, heads, d]`` over their padded block tables -> ``[b, heads * d]``."""
        kvh, d, bs = self.num_kv_heads, self.head_dim, self.block_size
        batch, max_blocks = blocks.shape
        # Whole blocks are contiguous rows of block_size*kvh*d elements: far cheaper to gather than slots.
        kd, vd = self._gather(k_cache, v_cache, blocks.reshape(-1))
        kd = kd.view(batch, max_blocks * bs, kvh, d).transpose(1, 2)
        vd = vd.view(batch, max_blocks * bs, kvh, d).transpose(1, 2)
        # The `group` query heads sharing a KV head become `group` query rows of that head (heads are laid
        # out so that head h reads KV head h // group, as in HF's repeat_kv).
        qd = q_dec.reshape(batch, kvh, self.group, d)
        o = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=self.scale)
        return o.reshape(batch, -1)
