"""The model runner's projections, ``x @ W.T + b``, each by the fastest means its device offers.

A decode step multiplies a few rows by every weight of the model, a skinny product that MKL does far below both
the memory and the compute limit of the machine. On CPU, for fp32 weights, ``csrc/packed_gemm.c`` packs each
weight once, at load, into the panels its register tiles stream through: it beats MKL's best form at every row
count from 1 to 512, by the most at the few rows of a decode step (``bench/kernels.py`` compares them), so the
packed kernel serves every size. It costs a second copy of the weights in memory (the HF model keeps its
own). Where the kernel cannot be built, or for other dtypes and devices, ``F.linear`` runs, on CPU as
``(W @ x.T).T`` where MKL is faster that way.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import torch
import torch.nn.functional as F

from switchyard.workers.executor.kernels import load_library

PANEL_WIDTH = 16  # NR in csrc/packed_gemm.c: output features per packed panel


def load_gemm_kernel() -> ctypes.CDLL | None:
    """The compiled ``packed_gemm`` library (built at first use), or None where it cannot be had."""
    lib = load_library("packed_gemm")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.pack_weight_f32.argtypes = [p, i64, i64, i64, p, i32]
        lib.pack_weight_f32.restype = None
        lib.packed_gemm_f32.argtypes = [p, i64, i64, i64, p, i64, p, i64, i32, i32]
        lib.packed_gemm_f32.restype = None
        lib.pack_weight_q8.argtypes = [p, i64, i64, i64, p, p, i32]
        lib.pack_weight_q8.restype = None
        lib.packed_gemm_q8.argtypes = [p, i64, i64, i64, p, p, i64, p, i64, i32, i32]
        lib.packed_gemm_q8.restype = None
    return lib


def load_w8a8_kernel() -> ctypes.CDLL | None:
    """The compiled ``int8_gemm`` library (int8 weights times int8 activations), or None where it cannot be had."""
    lib = load_library("int8_gemm")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.pack_weight_w8a8.argtypes = [p, i64, i64, i64, p, p, p, i32]
        lib.pack_weight_w8a8.restype = None
        lib.gemm_w8a8.argtypes = [p, i64, i64, i64, p, p, p, i64, p, i64, i32, i32, i32, p, ctypes.c_float]
        lib.gemm_w8a8.restype = None
        lib.w8a8_instructions.restype = i32
        lib.w8a8_group.restype = i32
    return lib


def load_w4a8_kernel() -> ctypes.CDLL | None:
    """The compiled ``int4_gemm`` library (4-bit weights times int8 activations), or None where it cannot be had."""
    lib = load_library("int4_gemm")
    if lib is not None:
        p, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.gemm_w4a8.argtypes = [p, i64, i64, i64, p, i64, p, i64, i32, i32, i32, p, ctypes.c_float]
        lib.gemm_w4a8.restype = None
        lib.w4a8_instructions.restype = i32
        lib.w4a8_block_bytes.restype = i32
    return lib


INT4_GROUP = 32  # GROUP in csrc/int8_rows.h: inputs per 4-bit group (GGUF's Q4_1 blocks are 32 too)
# What csrc/int8_rows.h's kernels do to a row before quantizing it (PROLOGUE_* there).
PROLOGUE_NONE, PROLOGUE_RMS_NORM, PROLOGUE_SILU_MUL = 0, 1, 2


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``weight [n, k]`` as GGUF's Q4_1 holds it: per output feature and group of 32 inputs, ``d = (max - min) / 15``
    and ``m = min`` in float16, and ``q = round((w - m) / d)`` in 0..15 (from the float16 d and m, so that
    ``d * q + m`` is as near w as they allow). Returns q ``[n, groups, 32]`` uint8 (k padded with zeros), d and m
    ``[n, groups]`` float16. A weight that came from a Q4_1 file (dequantized, even through bfloat16) gets its
    file's q back."""
    n, k = weight.shape
    groups = -(-k // INT4_GROUP)
    w = F.pad(weight.float(), (0, groups * INT4_GROUP - k)).view(n, groups, INT4_GROUP)
    low, high = w.amin(-1), w.amax(-1)
    d, m = ((high - low) / 15).half(), low.half()
    step = d.float().unsqueeze(-1)
    q = torch.where(step > 0, ((w - m.float().unsqueeze(-1)) / step).round(), torch.zeros_like(w))
    return q.clamp_(0, 15).to(torch.uint8), d, m


def pack_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """``quantize_int4``'s q, d and m in ``csrc/int4_gemm.c``'s layout: a block per panel of 16 features and group
    of 32 inputs, the nibbles of 4 chunks of 8 inputs (input c*8+t in the low nibble, c*8+4+t in the high one of
    byte t of a feature's 4), then the 16 d, then the 16 m."""
    n, groups, _ = q.shape
    panels = -(-n // PANEL_WIDTH)
    pad = panels * PANEL_WIDTH - n
    q, d, m = F.pad(q, (0, 0, 0, 0, 0, pad)), F.pad(d, (0, 0, 0, pad)), F.pad(m, (0, 0, 0, pad))
    halves = q.view(panels, PANEL_WIDTH, groups, 4, 2, 4)  # panel, feature, group, chunk, half, t
    nibbles = (halves[..., 0, :] | (halves[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # panel, group, chunk, feature, t
    scales = [t.view(panels, PANEL_WIDTH, groups).transpose(1, 2).contiguous().view(torch.uint8)
              .view(panels, groups, 2 * PANEL_WIDTH) for t in (d, m)]
    return torch.cat([nibbles.reshape(panels, groups, -1), *scales], dim=-1).contiguous().view(-1)


def uses_packed_kernel(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``Linear`` on this device and dtype packs its weight for ``csrc/packed_gemm.c``."""
    return device.type == "cpu" and dtype == torch.float32 and load_gemm_kernel() is not None


def _transposed_product_is_faster(rows: int, out_features: int) -> bool:
    """Whether MKL computes ``x @ W.T`` faster as ``(W @ x.T).T`` for ``rows`` rows of x (CPU, fp32).

    MKL picks its kernel by shape, and the transposed product gets the better one at 2-4 rows and from 13 rows up
    for a layer's projections, the plain one at 5-12 rows; for an LM head of tens of thousands of rows the
    transposed one wins from 2 rows (``bench/kernels.py`` measures both).
    """
    if out_features > 16384:
        return rows >= 2
    return 2 <= rows <= 4 or rows >= 13


def w8a8_instructions() -> str:
    """What ``csrc/int8_gemm.c`` multiplies with on this machine, as the worker's log names it."""
    lib = load_w8a8_kernel()
    return "none" if lib is None else ("plain C", "AVX2", "AVX-512 VNNI")[lib.w8a8_instructions()]


def w4a8_instructions() -> str:
    """What ``csrc/int4_gemm.c`` multiplies with on this machine, as the worker's log names it."""
    lib = load_w4a8_kernel()
    return "none" if lib is None else ("plain C", "AVX2", "AVX-512 VNNI")[lib.w4a8_instructions()]


QUANTIZATIONS = ("int8", "w8a8", "int4")


class Linear:
    """One projection: ``weight [out_features, in_features]`` and an optional ``bias [out_features]``.

    ``pack=True`` (CPU, fp32 only) packs the weight for the compiled kernel; ``weight`` is kept as given.
    ``quantize="int8"`` keeps it as int8 with a scale per output feature instead (weight-only: the products are in
    the activations' dtype, accumulated in fp32): on a CPU packed for ``csrc/packed_gemm.c`` (float32 activations),
    on a GPU as ``[out, in]`` for ``triton_int8.py``. ``quantize="w8a8"`` (CPU, fp32) quantizes each call's rows of
    x to int8 as well, one scale per 32 inputs, and sums the products in int32 (``csrc/int8_gemm.c``).
    ``quantize="int4"`` keeps 4 bits a weight with a scale and an offset per 32 inputs (GGUF's Q4_1): on a CPU (fp32)
    multiplied by the rows quantized as w8a8 does (``csrc/int4_gemm.c``), on a GPU widened to the activations'
    dtype inside the product (``triton_int4.py``).
    """

    __slots__ = ("weight", "bias", "packed", "scales", "offsets", "compensation", "_gemm", "_weight_ptrs",
                 "_gpu_linear", "_fuses")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = False,
                 quantize: str | None = None):
        self.weight = weight
        self.bias = bias
        self.packed: torch.Tensor | None = None
        self.scales: torch.Tensor | None = None
        self.offsets: torch.Tensor | None = None  # int4 on a GPU: each group's m (its d is in scales)
        self.compensation: torch.Tensor | None = None  # w8a8: per feature and group of inputs (csrc/int8_gemm.c)
        self._gemm = None
        self._weight_ptrs: tuple[int, ...] = ()  # the C kernel's weight arguments (packed, scales, ...)
        self._fuses = False  # the C kernel takes a prologue (csrc/int8_rows.h): a norm or SwiGLU done inside it
        # x -> x @ W.T + b, on a GPU (Triton: int8 or int4 weights)
        self._gpu_linear: Callable[[torch.Tensor], torch.Tensor] | None = None
        if quantize is not None and quantize not in QUANTIZATIONS:
            raise ValueError(f"quantization {quantize!r} is not one of {QUANTIZATIONS}")
        if quantize == "w8a8":
            self._pack_w8a8(weight)
        elif quantize == "int4" and weight.device.type == "cuda":
            from switchyard.workers.executor.triton_int4 import int4_linear, pack_int4_rows

            q, d, m = quantize_int4(weight)
            self.packed, self.scales, self.offsets = packed, d, m = pack_int4_rows(q), d, m
            self._gpu_linear = lambda x: int4_linear(x, packed, d, m, bias)
        elif quantize == "int4":
            self._pack_int4(weight)
        elif quantize and weight.device.type == "cuda":
            from switchyard.workers.executor.triton_int8 import int8_linear, quantize_int8

            self.packed, self.scales = q, scales = quantize_int8(weight)
            self._gpu_linear = lambda x: int8_linear(x, q, scales, bias)
        elif pack or quantize:
            lib = load_gemm_kernel()
            if lib is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
                raise ValueError("packing needs a float32 CPU weight and the compiled packed_gemm kernel")
            out_features, in_features = weight.shape
            panels = -(-out_features // PANEL_WIDTH)
            w = weight if weight.stride(1) == 1 else weight.contiguous()
            if quantize == "int8":
                self.packed = torch.empty(panels * in_features * PANEL_WIDTH, dtype=torch.int8)
                self.scales = torch.empty(panels * PANEL_WIDTH, dtype=torch.float32)
                lib.pack_weight_q8(w.data_ptr(), w.stride(0), out_features, in_features, self.packed.data_ptr(),
                                   self.scales.data_ptr(), torch.get_num_threads())
                self._gemm = lib.packed_gemm_q8
            else:
                self.packed = torch.empty(panels * in_features * PANEL_WIDTH, dtype=torch.float32)
                lib.pack_weight_f32(w.data_ptr(), w.stride(0), out_features, in_features, self.packed.data_ptr(),
                                    torch.get_num_threads())
                self._gemm = lib.packed_gemm_f32
            self._weight_ptrs = tuple(t.data_ptr() for t in (self.packed, self.scales) if t is not None)

    def _pack_w8a8(self, weight: torch.Tensor) -> None:
        lib = load_w8a8_kernel()
        if lib is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError("w8a8 needs a float32 CPU weight and the compiled int8_gemm kernel")
        out_features, in_features = weight.shape
        padded = -(-out_features // PANEL_WIDTH) * PANEL_WIDTH
        groups = -(-in_features // lib.w8a8_group())
        w = weight if weight.stride(1) == 1 else weight.contiguous()
        self.packed = torch.empty(padded * groups * lib.w8a8_group(), dtype=torch.int8)
        self.scales = torch.empty(padded, dtype=torch.float32)
        self.compensation = torch.empty(padded * groups, dtype=torch.int32)
        lib.pack_weight_w8a8(w.data_ptr(), w.stride(0), out_features, in_features, self.packed.data_ptr(),
                             self.scales.data_ptr(), self.compensation.data_ptr(), torch.get_num_threads())
        self._gemm = lib.gemm_w8a8
        self._weight_ptrs = (self.packed.data_ptr(), self.scales.data_ptr(), self.compensation.data_ptr())
        self._fuses = True

    def _pack_int4(self, weight: torch.Tensor) -> None:
        lib = load_w4a8_kernel()
        if lib is None or weight.device.type != "cpu" or weight.dtype != torch.float32:
            raise ValueError("int4 needs a float32 CPU weight and the compiled int4_gemm kernel")
        self.packed = pack_int4(*quantize_int4(weight))
        self._gemm = lib.gemm_w4a8
        self._weight_ptrs = (self.packed.data_ptr(),)
        self._fuses = True

    def after_rms_norm(self, h: torch.Tensor, weight: torch.Tensor, eps: float, ops) -> torch.Tensor:
        """``self(ops.rms_norm(h, weight, eps))``: with a kernel that quantizes its rows, the norm is done inside
        it, as it quantizes each row (a call and a pass over the activations fewer per projection)."""
        if self._fuses and h.stride(1) == 1:
            return self._kernel(h, h.shape[1], None, PROLOGUE_RMS_NORM, weight.data_ptr(), eps)
        return self(ops.rms_norm(h, weight, eps))

    def after_silu_mul(self, gate_up: torch.Tensor, ops, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``self(ops.silu_mul(gate_up), residual)``, SwiGLU done inside the kernel where it can be (see
        ``after_rms_norm``): ``gate_up [rows, 2 * in_features]`` is the stacked gate/up projection's output."""
        if self._fuses and gate_up.stride(1) == 1:
            return self._kernel(gate_up, gate_up.shape[1] // 2, residual, PROLOGUE_SILU_MUL)
        return self(ops.silu_mul(gate_up), residual=residual)

    def _kernel(self, x: torch.Tensor, in_features: int, residual: torch.Tensor | None,
                prologue: int = PROLOGUE_NONE, norm_weight: int | None = None, eps: float = 0.0) -> torch.Tensor:
        """The C kernel's product of ``x``'s rows (``in_features`` of each, after ``prologue``), added into
        ``residual`` in place where it is contiguous."""
        rows = x.shape[0]
        accumulate = residual is not None and residual.is_contiguous()
        out = (residual if accumulate and residual is not None
               else torch.empty(rows, self.out_features, dtype=torch.float32))
        tail = (prologue, norm_weight, eps) if self._fuses else ()
        assert self._gemm is not None
        self._gemm(x.data_ptr(), x.stride(0), rows, in_features, *self._weight_ptrs, self.out_features,
                   out.data_ptr(), out.stride(0), int(accumulate), torch.get_num_threads(), *tail)
        if self.bias is not None:
            out.add_(self.bias)
        return out if accumulate or residual is None else residual + out

    @property
    def packed_bytes(self) -> int:
        """Bytes of the packed copy (and its scales): memory beside the model's own weights."""
        if self.packed is None:
            return 0
        return sum(t.nbytes for t in (self.packed, self.scales, self.offsets, self.compensation) if t is not None)

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """``x [rows, in_features]`` -> ``x @ W.T + b (+ residual)``, ``[rows, out_features]``.

        With the packed kernel the product is added into ``residual`` in place (the caller's residual stream
        needs no separate add) and that tensor is returned; otherwise the result is a new tensor, or a transposed
        view of one.
        """
        if self._gpu_linear is not None:
            out = self._gpu_linear(x)
            return out if residual is None else residual + out
        if self._gemm is not None:
            if x.stride(1) != 1:
                x = x.contiguous()
            return self._kernel(x, x.shape[1], residual)
        if x.device.type != "cpu" or not _transposed_product_is_faster(x.shape[0], self.out_features):
            out = F.linear(x, self.weight, self.bias)
        else:
            out = torch.mm(self.weight, x.T).T
            if self.bias is not None:
                out = out + self.bias
        return out if residual is None else residual + out
