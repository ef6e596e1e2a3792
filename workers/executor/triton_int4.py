"""4-bit projections on a GPU: ``y = x @ W.T (+ b)`` with W in GGUF's Q4_1 form, ``w = d * q + m`` per output feature
and group of 32 inputs (q in 0..15), widened to the activations' dtype inside the kernel, so a decode step streams
about a sixth of a bf16 weight's bytes (0.625 a weight with the group's d and m, against 2).

    packed [N, G * 16] uint8   byte j of a feature's group g: input g*32+j in its low nibble, g*32+16+j in its high
                               one (a Q4_1 block's ``qs`` as GGUF stores it)
    d, m   [N, G] float16      G = K rounded up to 32, over 32 (the inputs past K are zeros)
    x [M, K], y [M, N] in x's dtype

Program ``(tile of M, tile of N)`` runs over K one group a time: the group's nibbles are split into its first and
second 16 inputs, each dequantized with the group's d and m and multiplied by the matching 16 columns of x (two
``tl.dot``), fp32 accumulation. ``M`` is kept out of Triton's specialisation as in triton_int8.py, so a GPU compiles
one variant per model shape at start and none while serving. Runs under ``TRITON_INTERPRET=1`` on CPU tensors
(tests), and ``bench/gpu.py --compile-only`` compiles it for sm_80 and sm_90.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

GROUP = 32  # inputs per group: GGUF's Q4_1 block, and linear.INT4_GROUP
BLOCK_M, BLOCK_N = 16, 64


# The stride of d and m (K / 32) is kept out too: it is a multiple of 16 in some layers and not in others (576 / 32),
# which would compile a second variant of a model's kernel.
@triton.jit(do_not_specialize=["M", "stride_sn"])
def _int4_linear_kernel(x_ptr, w_ptr, d_ptr, m_ptr, bias_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn,
                        stride_ym, HAS_BIAS: tl.constexpr, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, 16)
    row_mask, col_mask = rows < M, cols < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(0, tl.cdiv(K, 32)):
        k0 = g * 32
        nibbles = tl.load(w_ptr + cols[:, None] * stride_wn + (g * 16 + half)[None, :], mask=col_mask[:, None],
                          other=0)
        d = tl.load(d_ptr + cols * stride_sn + g, mask=col_mask, other=0.0).to(tl.float32)[:, None]
        m = tl.load(m_ptr + cols * stride_sn + g, mask=col_mask, other=0.0).to(tl.float32)[:, None]
        for part in tl.static_range(2):
            q = (nibbles >> (4 * part)) & 15
            w = q.to(tl.float32) * d + m
            ks = k0 + part * 16 + half
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                        mask=row_mask[:, None] & (ks < K)[None, :], other=0.0)
            acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=row_mask[:, None] & col_mask[None, :])


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """``linear.quantize_int4``'s q ``[N, G, 32]`` (values 0..15) as ``[N, G * 16]`` bytes in Q4_1's order: byte j of
    a group holds its input j in the low nibble and its input 16 + j in the high one."""
    n, groups, _ = q.shape
    return (q[..., :16] | (q[..., 16:] << 4)).reshape(n, groups * 16).contiguous()


def int4_linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] @ W.T (+ bias)``, ``[M, N]`` in x's dtype, W as ``pack_int4_rows`` and its d and m hold it."""
    if x.stride(1) != 1:
        x = x.contiguous()
    rows, k = x.shape
    n = packed.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _int4_linear_kernel[grid](x, packed, d, m, bias if bias is not None else d, y, rows, n, k, x.stride(0),
                              packed.stride(0), d.stride(0), y.stride(0), HAS_BIAS=bias is not None,
                              # fp32 activations multiply as fp32 (tf32 would round them to 10 bits)
                              PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
                              BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N)
    return y
