"""Attention over the paged KV cache, one backend per module (``base`` says what they share):

* ``sdpa``: torch ``scaled_dot_product_attention`` over gathered blocks; any device, the fallback.
* ``cpu_paged``: C kernels that read K/V in place through the block tables (CPU: decodes over fp32 and bf16 caches,
  prefill chunks over fp32 ones).
* ``triton``: Triton kernels that read K/V in place through the block tables (CUDA default, any block size).
* ``flash``: flash-attn's varlen kernel over the paged cache (CUDA, when installed and the block size allows).

Each backend's ``prepare()`` returns its own metadata type; the model runner only reads ``positions`` from it.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from switchyard.workers.executor.attention.base import AttentionMetadata, ChunkShape, PagedAttention
from switchyard.workers.executor.attention.flash import FLASH_BLOCK_MULTIPLE, FlashAttention, flash_attn_varlen
from switchyard.workers.executor.attention.sdpa import SdpaAttention

log = logging.getLogger("switchyard.attention")

__all__ = ["AttentionMetadata", "ChunkShape", "PagedAttention", "SdpaAttention", "make_attention"]


def make_attention(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    device: torch.device,
    backend: str | None = None,
    dtype: torch.dtype = torch.float32,
    kv_cache_dtype: str = "auto",
) -> PagedAttention[Any]:
    """``backend`` None picks, on CUDA, flash-attn when it is importable and the block size allows, else the Triton
    kernels; on CPU the compiled kernels for fp32 and bf16 caches when they build; else SDPA. The choice and its
    reason are logged. An int8 cache (``kv_cache_dtype``) is read by the CPU kernels only; elsewhere it is refused."""
    if kv_cache_dtype == "int8":
        if device.type != "cpu" or dtype != torch.float32 or backend not in (None, "cpu_paged"):
            raise ValueError(f"an int8 KV cache is read by the cpu_paged kernels, on a CPU in float32; this is "
                             f"{device.type}, {str(dtype).removeprefix('torch.')}, backend {backend or 'auto'}")
        from switchyard.workers.executor.attention.cpu_paged import CpuPagedAttention

        log.info("attention backend cpu_paged: an int8 cache")
        return CpuPagedAttention(num_heads, num_kv_heads, head_dim, block_size, device, dtype, kv_int8=True)
    if backend is None:
        backend, reason = "sdpa", "no paged kernel for this device and dtype"
        if device.type == "cuda":
            if block_size % FLASH_BLOCK_MULTIPLE == 0 and flash_attn_varlen():
                backend, reason = "flash", "flash-attn is installed and the block size is a multiple of 256"
            else:
                triton, reason = _working_triton(num_heads, num_kv_heads, head_dim, block_size, device, dtype)
                if triton is not None:
                    log.info("attention backend triton: %s", reason)
                    return triton
        elif device.type == "cpu" and dtype in (torch.float32, torch.bfloat16):
            from switchyard.workers.executor.attention.cpu_paged import load_kernel

            if load_kernel() is not None:
                cache = str(dtype).removeprefix("torch.")
                backend, reason = "cpu_paged", f"a {cache} cache on CPU and the C kernels built"
            else:
                reason = "the C kernels could not be built"
        log.info("attention backend %s: %s", backend, reason)
    if backend == "flash":
        return FlashAttention(num_heads, num_kv_heads, head_dim, block_size, device)
    if backend == "cpu_paged":
        from switchyard.workers.executor.attention.cpu_paged import CpuPagedAttention

        return CpuPagedAttention(num_heads, num_kv_heads, head_dim, block_size, device, dtype)
    if backend == "triton":
        from switchyard.workers.executor.attention.triton_paged import TritonAttention

        return TritonAttention(num_heads, num_kv_heads, head_dim, block_size, device, dtype)
    if backend == "sdpa":
        return SdpaAttention(num_heads, num_kv_heads, head_dim, block_size, device)
    raise ValueError(f"unknown attention backend {backend!r} (expected 'sdpa', 'cpu_paged', 'triton' or 'flash')")


def _working_triton(num_heads, num_kv_heads, head_dim, block_size, device,
                    dtype) -> tuple[PagedAttention[Any] | None, str]:
    """The Triton backend when its kernels run here (``triton_paged.probe``), else None; and the reason."""
    from switchyard.workers.executor.attention.triton_paged import TritonAttention, probe, triton_available

    why_not_flash = ("flash-attn is not installed" if not flash_attn_varlen() else
                     f"flash-attn needs a block size that is a multiple of {FLASH_BLOCK_MULTIPLE}")
    if not triton_available():
        return None, f"{why_not_flash} and Triton is not importable"
    attention = TritonAttention(num_heads, num_kv_heads, head_dim, block_size, device, dtype)
    failure = probe(attention, dtype)
    if failure is not None:
        log.warning("the Triton attention kernels failed their start-up check: %s", failure)
        return None, f"{why_not_flash} and the Triton kernels failed their start-up check ({failure})"
    return attention, f"{why_not_flash}; the kernels passed their start-up check"
