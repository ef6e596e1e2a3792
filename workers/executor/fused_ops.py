"""The elementwise steps of the runner's forward (RMSNorm, rotary embeddings, SwiGLU): torch ops, or on CPU for
fp32 the fused single-pass kernels of ``csrc/cpu_ops.c`` (see there for why).

Both implementations answer the same calls with the same results up to float rounding; ``make_ops`` picks one.
"""

from __future__ import annotations

import ctypes

import torch
import torch.nn.functional as F

from switchyard.workers.executor.kernels import load_library


class TorchOps:
    """The reference implementation, for every device and dtype."""

    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # HF's rounding order (normalise in fp32, round, then scale by the weight), so bf16 greedy matches HF's.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        return weight * xf.to(x.dtype)

    def rotary(self, qkv: torch.Tensor, num_heads: int, head_dim: int, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """The first ``num_heads`` heads of each row of ``qkv [T, >= num_heads * head_dim]`` rotated, as
        ``[T, num_heads, head_dim]``: HF's ``x * cos + rotate_half(x) * sin`` with ``cos``/``sin`` ``[T, d/2]``."""
        x = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        cos, sin = cos[:, None, :], sin[:, None, :]
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU: ``silu(gate) * up`` for the stacked ``[T, 2 * inter]`` gate/up projection."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up


class CpuFusedOps(TorchOps):
    """The same steps as single C passes over fp32 CPU tensors; ``rotary`` works in place on ``qkv``."""

    name = "cpu_fused"

    def __init__(self, lib: ctypes.CDLL):
        self._lib = lib

    def rms_norm(self, x, weight, eps):
        if x.stride(-1) != 1:
            x = x.contiguous()
        rows, dim = x.shape
        out = torch.empty(rows, dim, dtype=torch.float32)
        self._lib.rms_norm_f32(x.data_ptr(), x.stride(0), weight.data_ptr(), eps, out.data_ptr(), rows, dim,
                               torch.get_num_threads())
        return out

    def rotary(self, qkv, num_heads, head_dim, cos, sin):
        if qkv.stride(-1) != 1:
            qkv = qkv.contiguous()
        cos, sin = cos.contiguous(), sin.contiguous()
        self._lib.rotary_f32(qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, head_dim, cos.data_ptr(),
                             sin.data_ptr(), torch.get_num_threads())
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)

    def silu_mul(self, gate_up):
        gate_up = gate_up.contiguous()
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter, dtype=torch.float32)
        self._lib.silu_mul_f32(gate_up.data_ptr(), rows, inter, out.data_ptr(), torch.get_num_threads())
        return out


def load_ops_kernel() -> ctypes.CDLL | None:
    """The compiled ``cpu_ops`` library (built at first use), or None where it cannot be had."""
    lib = load_library("cpu_ops")
    if lib is not None:
        p, i64, i32, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
        lib.rms_norm_f32.argtypes = [p, i64, p, f32, p, i64, i64, i32]
        lib.silu_mul_f32.argtypes = [p, i64, i64, p, i32]
        lib.rotary_f32.argtypes = [p, i64, i64, i32, i32, p, p, i32]
        for fn in (lib.rms_norm_f32, lib.silu_mul_f32, lib.rotary_f32):
            fn.restype = None
    return lib


def make_ops(device: torch.device, dtype: torch.dtype) -> TorchOps:
    """The fused kernels on CPU for fp32 where they build, else torch."""
    if device.type == "cpu" and dtype == torch.float32:
        lib = load_ops_kernel()
        if lib is not None:
            return CpuFusedOps(lib)
    return TorchOps()
