"""CPU decode attention read straight from the paged KV cache, by a small C kernel compiled at first use.

On CPU the SDPA backend spends most of a decode step's attention time copying: every layer gathers each sequence's
KV blocks into a padded buffer (``index_select``), then SDPA reads the copy again. For 32 sequences of 50-528
tokens (SmolLM2, fp32, 2 threads) that was 91 ms of a 277 ms step. ``csrc/paged_decode.c`` reads each K/V row once,
in place, through the block table, for all query heads that share it. It is built and loaded by
``executor.kernels``; where it cannot be, ``make_attention`` keeps the SDPA backend.
"""

from __future__ import annotations

import ctypes

import torch

from switchyard.workers.executor.attention import SdpaAttention, StepMetadata
from switchyard.workers.executor.kernels import load_library


def load_kernel() -> ctypes.CDLL | None:
    """The compiled ``paged_decode`` library (built at first use), or None where it cannot be had."""
    lib = load_library("paged_decode")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.paged_decode_f32.argtypes = [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32]
        lib.paged_decode_f32.restype = i32
    return lib


def load_prefill_kernel() -> ctypes.CDLL | None:
    """The compiled ``prefill_attention`` library (built at first use), or None where it cannot be had."""
    lib = load_library("prefill_attention")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.prefill_workspace_floats.argtypes = [i64, i32, i32, i32, i32]
        lib.prefill_workspace_floats.restype = i64
        lib.prefill_attention_f32.argtypes = [p, i64, p, p, p, i64, i64, p, i64, i32, i32, i32, i32, ctypes.c_float,
                                              p, i32]
        lib.prefill_attention_f32.restype = i32
    return lib


class CpuPagedAttention(SdpaAttention):
    """C kernels for decodes (``csrc/paged_decode.c``) and prefill chunks (``csrc/prefill_attention.c``, where it
    builds and takes the head size; SDPA otherwise), fp32 caches on CPU."""

    name = "cpu_paged"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device):
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, device)
        lib = load_kernel()
        if lib is None:
            raise RuntimeError("the CPU decode kernel (csrc/paged_decode.c) could not be built")
        self._kernel = lib.paged_decode_f32
        self._prefill_lib = load_prefill_kernel() if head_dim % 16 == 0 else None  # 16: the kernel's panel width
        self._workspace = torch.empty(0)

    def prepare(self, chunks):
        meta = super().prepare(chunks)
        if self._prefill_lib is not None and meta.prefills:
            # Sized once per step for its longest prefill context; every layer reuses it.
            context = max(span.start_pos + span.num_tokens for span in meta.prefills)
            need = self._prefill_lib.prefill_workspace_floats(context, self.num_heads, self.num_kv_heads,
                                                              self.head_dim, torch.get_num_threads())
            if self._workspace.numel() < need:  # grown, never shrunk: a fresh buffer per step costs page faults
                self._workspace = torch.empty(need, dtype=torch.float32)
        return meta

    def _attend_prefill(self, span, qs, ks, vs, k_cache, v_cache) -> torch.Tensor:
        lib = self._prefill_lib
        if lib is None or qs.stride(2) != 1 or qs.stride(1) != self.head_dim:
            return super()._attend_prefill(span, qs, ks, vs, k_cache, v_cache)
        out = qs.new_empty(span.num_tokens, self.num_heads * self.head_dim)
        status = lib.prefill_attention_f32(
            qs.data_ptr(), qs.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), span.table.data_ptr(),
            span.start_pos, span.num_tokens, out.data_ptr(), out.stride(0), self.num_heads, self.num_kv_heads,
            self.head_dim, self.block_size, self.scale, self._workspace.data_ptr(), torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"prefill_attention_f32 failed with status {status}")
        return out

    def _prepare_decodes(self, meta: StepMetadata, table: torch.Tensor, num_blocks: list[int]) -> None:
        # The kernel walks each table only up to the sequence's own length: no masks, no padding work, no groups.
        meta.decode_blocks = table[:, : max(num_blocks)].contiguous()
        meta.decode_context_lens = (meta.positions[meta.num_prefill_tokens :] + 1).contiguous()

    def _attend_decodes(self, q_dec, k_cache, v_cache, meta: StepMetadata) -> torch.Tensor:
        if q_dec.stride(2) != 1 or q_dec.stride(1) != self.head_dim:
            q_dec = q_dec.contiguous()
        batch = q_dec.shape[0]
        out = q_dec.new_empty(batch, self.num_heads * self.head_dim)
        status = self._kernel(
            q_dec.data_ptr(), q_dec.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            meta.decode_blocks.data_ptr(), meta.decode_blocks.stride(0), meta.decode_context_lens.data_ptr(),
            out.data_ptr(), batch, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, self.scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"paged_decode_f32 failed with status {status}")
        return out
