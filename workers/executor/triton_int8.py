"""Weight-only int8 projections on a GPU: ``y = x @ (q * s).T (+ b)``, the weight read as int8 and widened to the
activations' dtype inside the kernel, so a decode step streams a quarter of an fp32 weight's bytes (half of bf16's).

    q [N, K] int8, s [N] fp32 (per output feature, symmetric: max |w| / 127), x [M, K], y [M, N] in x's dtype

Program ``(tile of M, tile of N)`` runs over K in ``BLOCK_K`` steps with one ``tl.dot`` each, fp32 accumulation;
the scale is applied once at the end. ``M`` changes with every step (the batch) and is kept out of Triton's
specialisation, as the attention kernels keep theirs (triton_kernels.py), so a GPU compiles one variant per model
shape at start and none while serving. Runs under ``TRITON_INTERPRET=1`` on CPU tensors (tests), and
``bench/gpu.py --compile-only`` compiles it for sm_80 and sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit(do_not_specialize=["M"])
def _int8_linear_kernel(x_ptr, w_ptr, scale_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + ks < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=row_mask[:, None] & k_mask[None, :],
                    other=0.0)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + (k0 + ks)[None, :], mask=col_mask[:, None] & k_mask[None, :],
                    other=0)
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    acc *= tl.load(scale_ptr + cols, mask=col_mask, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` as int8 and its fp32 scale per output feature (symmetric; an all-zero feature: scale 0),
    rounded half away from zero as the CPU kernel rounds (csrc/packed_gemm.c)."""
    w = weight.float()
    peak = w.abs().amax(dim=1)
    q = w * torch.where(peak > 0, 127 / peak, torch.zeros_like(peak))[:, None]
    q = torch.where(q < 0, q - 0.5, q + 0.5).trunc().to(torch.int8)
    return q.contiguous(), (peak / 127).contiguous()


def int8_linear(x: torch.Tensor, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None,
                ) -> torch.Tensor:
    """``x [M, K] @ (q * scales).T (+ bias)``, ``[M, N]`` in x's dtype (``quantize_int8`` made q and scales)."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = q.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int8_linear_kernel[grid](x, q, scales, bias if bias is not None else scales, y, rows, n, k, x.stride(0),
                              q.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                              # fp32 activations multiply as fp32 (tf32 would round them to 10 bits)
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
