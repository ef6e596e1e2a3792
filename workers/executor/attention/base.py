"""What every attention backend shares: the paged cache layout, the step's row layout, and the slot plan.

The cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence owns
a list of blocks (its block table); position ``p`` lives in block ``table[p // block_size]`` at offset
``p % block_size``, i.e. at flat slot ``table[p // block_size] * block_size + p % block_size`` of the cache viewed
as ``[num_blocks * block_size, num_kv_heads, head_dim]``.

A step is one flat batch of T new tokens, multi-token chunks (prefills) first, then the one-token chunks (decodes):

    rows:  | prefill 0 (n0) | prefill 1 (n1) | ... | decode 0 | decode 1 | ... | decode B-1 |
           <--------- num_prefill_tokens ---------> <------------ B rows, 1 each ----------->

Everything that depends only on the step's shape (slots, positions, block tables, masks) is built once per step by
``prepare()`` into the backend's own metadata type; ``forward()`` runs once per layer and only does tensor work.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from switchyard.workers.executor.transfers import to_device

# (start_pos, num_tokens, block_table) of one chunk, in the step's row order (prefills first).
ChunkShape = tuple[int, int, Sequence[int]]


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors every backend has; each backend's own metadata type adds what its kernels read."""

    positions: torch.Tensor  # [T] long, position of each new token (for rotary embeddings)
    slot_mapping: torch.Tensor  # [T] long, flat cache slot each new token's K/V is written to
    num_prefill_tokens: int  # rows before the first decode


MetadataT = TypeVar("MetadataT", bound=AttentionMetadata)


class PagedAttention(Protocol[MetadataT]):
    """``prepare`` once per step (chunks ordered: multi-token ones first), then ``forward`` once per layer.

    ``forward`` writes the new tokens' K/V into the layer's cache, then returns attention output ``[T, heads * d]``
    for q ``[T, heads, d]`` and k/v ``[T, kv_heads, d]`` (rotary already applied). ``MetadataT``: the backend's
    own metadata type, which ``prepare`` makes and ``forward`` reads (a caller of any backend holds
    ``PagedAttention[Any]``).
    """

    name: str

    def prepare(self, chunks: Sequence[ChunkShape]) -> MetadataT: ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: MetadataT) -> torch.Tensor: ...


class HeadLayout:
    """What every backend keeps of the model's attention: query and KV heads (and their ratio), head size, the
    cache's block size and device, and the softmax scale."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int,
                 device: torch.device) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.device = device
        self.scale = head_dim**-0.5


@dataclass(slots=True)
class SlotPlan:
    """Where a step's tokens sit: positions, cache slots, and the block tables of its chunks."""

    positions: torch.Tensor  # [T] long
    slot_mapping: torch.Tensor  # [T] long
    tables: torch.Tensor  # [C, max_blocks] long: each chunk's blocks up to its last position, zero-padded
    num_blocks: list[int]  # per chunk: blocks covering positions [0, start_pos + num_tokens)
    num_prefill_tokens: int


def plan_slots(chunks: Sequence[ChunkShape], block_size: int, device: torch.device) -> SlotPlan:
    """Positions, slots and the padded block tables of a step (only the blocks the step touches).

    Built on the host (every input is a Python list) and copied once per tensor, so the device never waits for
    the host nor the host for the device.
    """
    num_blocks = [(start + n + block_size - 1) // block_size for start, n, _ in chunks]
    max_blocks = max(num_blocks)
    rows: list[list[int]] = []
    positions: list[int] = []
    slots: list[int] = []
    for (start, n, table), nb in zip(chunks, num_blocks):
        if len(table) < nb:
            raise ValueError(f"block table has {len(table)} blocks, positions up to {start + n - 1} need {nb}")
        rows.append([*table[:nb], *itertools.repeat(0, max_blocks - nb)])
        positions.extend(range(start, start + n))
        slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in range(start, start + n))
    num_prefill_tokens = sum(n for _, n, _ in chunks if n > 1)
    return SlotPlan(to_device(positions, torch.long, device), to_device(slots, torch.long, device),
                    to_device(rows, torch.long, device), num_blocks, num_prefill_tokens)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
             v: torch.Tensor) -> None:
    """Store the step's new K/V ``[T, kv_heads, d]`` at their flat slots of one layer's cache."""
    kv_heads, d = k.shape[1], k.shape[2]
    k_cache.view(-1, kv_heads, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, d).index_copy_(0, slot_mapping, v)
