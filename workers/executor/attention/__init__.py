"""Attention over the paged KV cache, one backend per module (``base`` says what they share):

* ``sdpa``: torch ``scaled_dot_product_attention`` over gathered blocks; any device, the fallback.
* ``cpu_paged``: C kernels that read K/V in place through the block tables (CPU, fp32 caches).
* ``flash``: flash-attn's varlen kernel over the paged cache (CUDA, when installed and the block size allows).

Each backend's ``prepare()`` returns its own metadata type; the model runner only reads ``positions`` from it.
"""

from __future__ import annotations

import torch

from switchyard.workers.executor.attention.base import AttentionMetadata, ChunkShape, PagedAttention
from switchyard.workers.executor.attention.flash import FLASH_BLOCK_MULTIPLE, FlashAttention, flash_attn_varlen
from switchyard.workers.executor.attention.sdpa import SdpaAttention

__all__ = ["AttentionMetadata", "ChunkShape", "PagedAttention", "SdpaAttention", "make_attention"]


def make_attention(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
    backend: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> PagedAttention:
    """``backend`` None picks flash-attn on CUDA when it is importable and the block size allows, the compiled
    kernels on CPU for fp32 caches when they build, else SDPA."""
    if backend is None:
        backend = "sdpa"
        if device.type == "cuda" and block_size % FLASH_BLOCK_MULTIPLE == 0 and flash_attn_varlen():
            backend = "flash"
        elif device.type == "cpu" and dtype == torch.float32:
            from switchyard.workers.executor.attention.cpu_paged import load_kernel

            backend = "cpu_paged" if load_kernel() is not None else "sdpa"
    if backend == "flash":
        return FlashAttention(num_heads, num_kv_heads, head_dim, block_size, device)
    if backend == "cpu_paged":
        from switchyard.workers.executor.attention.cpu_paged import CpuPagedAttention

        return CpuPagedAttention(num_heads, num_kv_heads, head_dim, block_size, device)
    if backend == "sdpa":
        return SdpaAttention(num_heads, num_kv_heads, head_dim, block_size, device)
    raise ValueError(f"unknown attention backend {backend!r} (expected 'sdpa', 'cpu_paged' or 'flash')")
