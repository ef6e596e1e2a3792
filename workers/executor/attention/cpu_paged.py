"""CPU attention read straight from the paged KV cache, by small C kernels compiled at first use.

On CPU the SDPA backend spends most of a decode step's attention time copying: every layer gathers each sequence's
KV blocks into a padded buffer (``index_select``), then SDPA reads the copy again, a large part of a step with
many sequences. ``csrc/paged_decode.c`` reads each K/V row once,
in place, through the block table, for all query heads that share it; ``csrc/prefill_attention.c`` does the same
for prefill chunks (SDPA takes them where it cannot be had). Both are built and loaded by ``executor.kernels``;
where the decode kernel cannot be, ``make_attention`` keeps the SDPA backend.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from switchyard.workers.executor.attention.base import AttentionMetadata, ChunkShape, HeadLayout, plan_slots, write_kv
from switchyard.workers.executor.attention.sdpa import PrefillSpan, SdpaAttention, prefill_spans
from switchyard.workers.executor.kernels import load_library

PANEL_WIDTH = 16  # the prefill kernel's register tile: it takes head sizes that are a multiple of this


def load_kernel() -> ctypes.CDLL | None:
    """The compiled ``paged_decode`` library (built at first use), or None where it cannot be had."""
    lib = load_library("paged_decode")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        for kernel in (lib.paged_decode_f32, lib.paged_decode_bf16, lib.paged_decode_i8):
            kernel.argtypes = [p, i64, p, p, p, i64, p, p, i32, i32, i32, i32, i32, ctypes.c_float, i32]
            kernel.restype = i32
        lib.write_kv_i8.argtypes = [p, i64, p, i64, p, i64, i32, i32, p, p]
        lib.write_kv_i8.restype = None
    return lib


def load_prefill_kernel() -> ctypes.CDLL | None:
    """The compiled ``prefill_attention`` library (built at first use), or None where it cannot be had."""
    lib = load_library("prefill_attention")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.prefill_workspace_floats.argtypes = [i64, i32, i32, i32, i32]
        lib.prefill_workspace_floats.restype = i64
        lib.prefill_attention.argtypes = [p, i64, p, p, i32, p, i64, i64, p, i64, i32, i32, i32, i32, ctypes.c_float,
                                          p, i32]
        lib.prefill_attention.restype = i32
    return lib


@dataclass(slots=True)
class CpuPagedMetadata(AttentionMetadata):
    prefills: list[PrefillSpan]  # with SDPA's masks only where the prefill kernel is not available
    decode_tables: torch.Tensor | None  # [B, max_blocks] long, contiguous; the kernel stops at each length
    decode_context_lens: torch.Tensor | None  # [B] long


class CpuPagedAttention(HeadLayout):
    """C kernels for decodes (``csrc/paged_decode.c``, fp32, bf16 and int8 caches) and prefill chunks
    (``csrc/prefill_attention.c``: fp32 and int8 caches, where it builds and takes the head size; SDPA otherwise), on
    CPU.

    ``kv_int8``: the cache holds each (position, KV head) row as ``head_dim`` int8 values and then the float32 scale
    they were quantized by (symmetric: the row's largest magnitude is 127), ``[..., head_dim + 4]`` int8. One scale a
    row, not a block, as decode appends one position at a time and a block's scale would have to change under the
    rows already in it. The kernels widen each row once and keep fp32 arithmetic; SDPA cannot read such a cache, so
    it needs the prefill kernel too."""

    name = "cpu_paged"
    dtypes = (torch.float32, torch.bfloat16)  # the caches the decode kernel reads (and int8 rows)

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, block_size: int, device: torch.device,
                 dtype: torch.dtype = torch.float32, kv_int8: bool = False):
        if dtype not in self.dtypes or (kv_int8 and dtype != torch.float32):
            raise ValueError(f"the CPU decode kernel reads fp32, bf16 or (with fp32) int8 caches, not {dtype}")
        lib = load_kernel()
        if lib is None:
            raise RuntimeError("the CPU decode kernel (csrc/paged_decode.c) could not be built")
        super().__init__(num_heads, num_kv_heads, head_dim, block_size, device)
        self.kv_int8 = kv_int8
        self._write_kv_i8 = lib.write_kv_i8
        self._decode_kernel = (lib.paged_decode_i8 if kv_int8 else
                               lib.paged_decode_f32 if dtype == torch.float32 else lib.paged_decode_bf16)
        self._decode_kernel_name = self._decode_kernel.__name__
        fp32_prefill = dtype == torch.float32 and head_dim % PANEL_WIDTH == 0
        self._prefill_lib = load_prefill_kernel() if fp32_prefill else None
        if kv_int8 and self._prefill_lib is None:
            raise ValueError(f"an int8 KV cache needs the prefill kernel (csrc/prefill_attention.c), which takes "
                             f"head sizes that are a multiple of {PANEL_WIDTH} (this is {head_dim}) where it builds")
        self._sdpa = None if self._prefill_lib is not None else SdpaAttention(
            num_heads, num_kv_heads, head_dim, block_size, device)
        self._workspace = torch.empty(0)

    def prepare(self, chunks: Sequence[ChunkShape]) -> CpuPagedMetadata:
        plan = plan_slots(chunks, self.block_size, self.device)
        prefills = prefill_spans(plan, chunks, with_masks=self._sdpa is not None)
        if self._prefill_lib is not None and prefills:
            # Sized once per step for its longest prefill context; every layer reuses it.
            context = max(span.start_pos + span.num_tokens for span in prefills)
            need = self._prefill_lib.prefill_workspace_floats(context, self.num_heads, self.num_kv_heads,
                                                              self.head_dim, torch.get_num_threads())
            if self._workspace.numel() < need:  # grown, never shrunk: a fresh buffer per step costs page faults
                self._workspace = torch.empty(need, dtype=torch.float32)
        tables = context_lens = None
        if len(prefills) < len(chunks):
            # The kernel walks each table only up to the sequence's own length: no masks, no padding work.
            tables = plan.tables[len(prefills):, : max(plan.num_blocks[len(prefills):])].contiguous()
            context_lens = (plan.positions[plan.num_prefill_tokens :] + 1).contiguous()
        return CpuPagedMetadata(plan.positions, plan.slot_mapping, plan.num_prefill_tokens, prefills, tables,
                                context_lens)

    def forward(self, q, k, v, k_cache, v_cache, meta: CpuPagedMetadata) -> torch.Tensor:
        """q ``[T, heads, d]``, k/v ``[T, kv_heads, d]`` (rotary applied) -> attention output ``[T, heads * d]``."""
        if self.kv_int8:
            self._write_int8(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            write_kv(k_cache, v_cache, meta.slot_mapping, k, v)
        outs = []
        for span in meta.prefills:
            rows = slice(span.row, span.row + span.num_tokens)
            if self._sdpa is not None:
                outs.append(self._sdpa.attend_prefill(span, q[rows], k[rows], v[rows], k_cache, v_cache))
            else:
                outs.append(self._attend_prefill(span, q[rows], k_cache, v_cache))
        if meta.decode_tables is not None:
            outs.append(self._attend_decodes(q[meta.num_prefill_tokens :], k_cache, v_cache, meta))
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def _write_int8(self, k, v, k_cache, v_cache, slots: torch.Tensor) -> None:
        """The step's new K/V rows into int8 caches (the class doc's format), in one C call a layer."""
        if k.stride(2) != 1 or k.stride(1) != self.head_dim:
            k = k.contiguous()
        if v.stride(2) != 1 or v.stride(1) != self.head_dim:
            v = v.contiguous()
        self._write_kv_i8(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr(), k.shape[0],
                          self.num_kv_heads, self.head_dim, k_cache.data_ptr(), v_cache.data_ptr())

    def _attend_prefill(self, span: PrefillSpan, qs, k_cache, v_cache) -> torch.Tensor:
        assert self._prefill_lib is not None  # forward comes here only where SDPA is not needed: the kernel loaded
        if qs.stride(2) != 1 or qs.stride(1) != self.head_dim:
            qs = qs.contiguous()
        out = qs.new_empty(span.num_tokens, self.num_heads * self.head_dim)
        status = self._prefill_lib.prefill_attention(
            qs.data_ptr(), qs.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), int(self.kv_int8),
            span.table.data_ptr(), span.start_pos, span.num_tokens, out.data_ptr(), out.stride(0), self.num_heads,
            self.num_kv_heads, self.head_dim, self.block_size, self.scale, self._workspace.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"prefill_attention failed with status {status}")
        return out

    def _attend_decodes(self, q_dec, k_cache, v_cache, meta: CpuPagedMetadata) -> torch.Tensor:
        tables, context_lens = meta.decode_tables, meta.decode_context_lens
        assert tables is not None and context_lens is not None  # forward comes here only for a step with decodes
        if q_dec.stride(2) != 1 or q_dec.stride(1) != self.head_dim:
            q_dec = q_dec.contiguous()
        batch = q_dec.shape[0]
        out = q_dec.new_empty(batch, self.num_heads * self.head_dim)
        status = self._decode_kernel(
            q_dec.data_ptr(), q_dec.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            tables.data_ptr(), tables.stride(0), context_lens.data_ptr(),
            out.data_ptr(), batch, self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, self.scale,
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"{self._decode_kernel_name} failed with status {status}")
        return out
