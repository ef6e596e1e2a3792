"""The runner's projections: the packed CPU kernel against ``F.linear``, and the fallback without it."""

from __future__ import annotations

import ctypes

import pytest
import torch
import torch.nn.functional as F

from switchyard.workers.executor.linear import (
    Linear,
    load_gemm_kernel,
    load_w4a8_kernel,
    load_w8a8_kernel,
    quantize_int4,
    uses_packed_kernel,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def kernel(compiled):
    return compiled(load_gemm_kernel, "csrc/packed_gemm.c")


# Output features that fill whole 16-wide panels and ones that leave a partial last panel; rows from a single
# decode through every row-tile remainder to a prefill-sized batch.
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (50, 72), (7, 576), (1000, 40)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32, 67])
def test_packed_matches_f_linear(kernel, out_features, in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    for b in (None, bias):
        layer = Linear(weight, b, pack=True)
        assert layer.packed is not None
        torch.testing.assert_close(layer(x), F.linear(x, weight, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("pack", [True, False])
def test_residual_is_added(kernel, pack):
    """``residual=`` returns residual + x @ W.T (+ b); the packed kernel adds into the residual tensor itself."""
    weight, bias = torch.randn(50, 32), torch.randn(50)
    x, residual = torch.randn(7, 32), torch.randn(7, 50)
    expected = residual + F.linear(x, weight, bias)
    out = Linear(weight, bias, pack=pack)(x, residual=residual.clone() if not pack else residual)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
    if pack:
        assert out is residual


def test_packed_takes_strided_rows(kernel):
    """Rows with a stride (a slice of a wider activation) and a non-contiguous weight are read correctly."""
    weight = torch.randn(40, 48).T.contiguous().T[:, :48]  # column-major storage
    wide = torch.randn(9, 100)
    x = wide[:, 10:58]
    torch.testing.assert_close(Linear(weight, pack=True)(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_packed_weight_is_a_copy(kernel):
    weight = torch.randn(32, 16)
    layer = Linear(weight, pack=True)
    x = torch.randn(3, 16)
    before = layer(x)
    assert layer.weight is weight  # kept as given, for the HF model that shares it
    weight.zero_()
    torch.testing.assert_close(layer(x), before)  # packed at construction; later writes do not reach it


def test_packing_only_for_cpu_float32(kernel):
    assert uses_packed_kernel(CPU, torch.float32)
    assert not uses_packed_kernel(CPU, torch.bfloat16)
    with pytest.raises(ValueError, match="float32"):
        Linear(torch.randn(16, 16, dtype=torch.bfloat16), pack=True)


@pytest.mark.parametrize("rows", [1, 3, 8, 20])
def test_unpacked_fallback_matches_f_linear(rows):
    weight, bias = torch.randn(80, 24), torch.randn(80)
    x = torch.randn(rows, 24)
    torch.testing.assert_close(Linear(weight, bias)(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


def test_no_compiler_means_no_packing(no_compiler, caplog):
    assert not uses_packed_kernel(CPU, torch.float32)
    assert "packed_gemm.c" in caplog.text


def _int8_reference(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as symmetric per-output-feature int8 gives it back: q * s, s = max|w| / 127, q = w * (127 / max|w|)
    rounded half away from zero (as the kernel rounds)."""
    peak = weight.abs().amax(dim=1, keepdim=True)
    q = weight * torch.where(peak > 0, 127 / peak, 0)
    return torch.where(q < 0, q - 0.5, q + 0.5).trunc() * (peak / 127)


@pytest.mark.parametrize("out_features,in_features", [(96, 64), (50, 72), (7, 576), (1000, 40)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32])
def test_int8_matches_the_dequantized_weight_and_stays_near_the_float_one(kernel, out_features, in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + 7)
    weight = torch.randn(out_features, in_features, generator=gen)
    weight[0] = 0  # an all-zero output feature: its scale is 0, its outputs the bias
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    for b in (None, bias):
        layer = Linear(weight, b, quantize="int8")
        assert layer.packed is not None and layer.packed.dtype == torch.int8
        out = layer(x)
        torch.testing.assert_close(out, F.linear(x, _int8_reference(weight), b), rtol=1e-4, atol=1e-3)
        # The quantization error itself (Gaussian weights: about 1% of the output's size).
        error = (out - F.linear(x, weight, b)).norm() / F.linear(x, weight, b).norm()
        assert error < 0.02, error


def test_int8_holds_a_quarter_of_the_bytes_and_refuses_what_it_cannot_run(kernel):
    weight = torch.randn(64, 128)
    assert Linear(weight, quantize="int8").packed_bytes == 64 * 128 + 64 * 4
    assert Linear(weight, pack=True).packed_bytes == 64 * 128 * 4
    with pytest.raises(ValueError, match="int3"):
        Linear(weight, quantize="int3")
    with pytest.raises(ValueError, match="float32"):
        Linear(weight.bfloat16(), quantize="int8")


@pytest.fixture(scope="module")
def w8a8_kernel(compiled):
    return compiled(load_w8a8_kernel, "csrc/int8_gemm.c")


def _quantized_rows(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as csrc/int8_rows.h quantizes it, given back: per ``group`` inputs of a row, rounded half away from zero to
    int8 with a scale of max|x| / 127."""
    rows, k = x.shape
    padded = -(-k // group) * group
    xg = F.pad(x, (0, padded - k)).view(rows, -1, group)
    peak = xg.abs().amax(-1, keepdim=True)
    q = xg * torch.where(peak > 0, 127 / peak, 0)
    return (torch.where(q < 0, q - 0.5, q + 0.5).trunc() * (peak / 127)).view(rows, padded)[:, :k]


def _w8a8_reference(x: torch.Tensor, weight: torch.Tensor, group: int) -> torch.Tensor:
    """x @ W.T as csrc/int8_gemm.c computes it: W per output feature and x per ``group`` inputs of a row, each
    rounded half away from zero to int8, the products summed exactly."""
    return (_quantized_rows(x, group).double() @ _int8_reference(weight).double().T).float()


def _int4_weight(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` as 4-bit groups give it back: d * q + m (``quantize_int4``)."""
    q, d, m = quantize_int4(weight)
    return (d.float().unsqueeze(-1) * q.float() + m.float().unsqueeze(-1)).view(weight.shape[0], -1)[
        :, : weight.shape[1]]


def _int4_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ W.T as csrc/int4_gemm.c computes it: W in 4-bit groups, x quantized as w8a8 quantizes it."""
    return (_quantized_rows(x, 32).double() @ _int4_weight(weight).double().T).float()


# Rows through every tile remainder of each instruction set's tile (8 rows for VNNI, 3 for AVX2); inputs that fill
# whole groups of 32 and ones that leave a partial last group.
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (50, 72), (7, 576), (1000, 40), (33, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13, 32])
def test_w8a8_matches_its_integer_reference_and_stays_near_the_float_product(w8a8_kernel, out_features,
                                                                              in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + 11)
    weight = torch.randn(out_features, in_features, generator=gen)
    weight[0] = 0  # an all-zero output feature: its scale is 0, its outputs the bias
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    x[-1, : max(1, in_features // 2)] = 0  # a group of zeros: its scale is 0
    expected = _w8a8_reference(x, weight, w8a8_kernel.w8a8_group())
    for b in (None, bias):
        out = Linear(weight, b, quantize="w8a8")(x)
        torch.testing.assert_close(out, expected if b is None else expected + b, rtol=1e-4, atol=1e-3)
        if in_features >= 32:  # the quantization error itself (Gaussian weights and inputs: about 1%)
            error = (out - F.linear(x, weight, b)).norm() / F.linear(x, weight, b).norm()
            assert error < 0.03, error


@pytest.mark.parametrize("quantize", ["int8", "w8a8", "int4"])
def test_int8_adds_into_the_residual_and_takes_strided_rows(kernel, w8a8_kernel, int4_kernel, quantize):
    weight, bias = torch.randn(50, 48), torch.randn(50)
    wide, residual = torch.randn(7, 100), torch.randn(7, 50)
    x = wide[:, 10:58]
    product = (F.linear(x, _int8_reference(weight)) if quantize == "int8"
               else _w8a8_reference(x, weight, w8a8_kernel.w8a8_group()) if quantize == "w8a8"
               else _int4_reference(x, weight))
    expected = residual + product + bias
    out = Linear(weight, bias, quantize=quantize)(x, residual=residual)
    assert out is residual
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)


def test_w8a8_holds_about_a_quarter_of_the_bytes_and_refuses_what_it_cannot_run(w8a8_kernel):
    weight = torch.randn(64, 128)
    groups = 128 // w8a8_kernel.w8a8_group()
    assert Linear(weight, quantize="w8a8").packed_bytes == 64 * 128 + 64 * 4 + 64 * groups * 4
    with pytest.raises(ValueError, match="float32"):
        Linear(weight.bfloat16(), quantize="w8a8")


# The instruction sets other CPUs take (csrc/int8_gemm.c and int4_gemm.c pick one at compile time): each built here
# as it would be there, where this CPU can run it, and checked against the same reference.
@pytest.mark.parametrize("flags,instructions", [(("-mno-avx512f",), 1), (("-mno-avx512f", "-mno-avx2"), 0)])
@pytest.mark.parametrize("quantize,name", [("w8a8", "int8_gemm"), ("int4", "int4_gemm")])
def test_int8_activations_on_every_instruction_set_match_their_integer_reference(
        w8a8_kernel, int4_kernel, tmp_path, monkeypatch, flags, instructions, quantize, name):
    from switchyard.workers.executor import kernels, linear

    if instructions == 1 and "avx2" not in kernels.cpu_flags().split():
        pytest.skip("this CPU has no AVX2")
    target = tmp_path / f"{name}.so"
    kernels.compile_kernel(name, target, kernels.find_compiler() or "cc", flags)
    lib = ctypes.CDLL(str(target))
    answer = getattr(lib, f"{quantize.replace('int4', 'w4a8')}_instructions")
    answer.restype = ctypes.c_int
    assert answer() == instructions
    monkeypatch.setattr(linear, "load_library", lambda _: lib)
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 2, 3, 4, 7):
        weight, x = torch.randn(40, 100, generator=gen), torch.randn(rows, 100, generator=gen)
        out = Linear(weight, quantize=quantize)(x)
        expected = _w8a8_reference(x, weight, 32) if quantize == "w8a8" else _int4_reference(x, weight)
        torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)


@pytest.fixture(scope="module")
def int4_kernel(compiled):
    return compiled(load_w4a8_kernel, "csrc/int4_gemm.c")


# As for w8a8: every row tile remainder, whole and partial groups and panels.
@pytest.mark.parametrize("out_features,in_features", [(96, 64), (50, 72), (7, 576), (1000, 40), (33, 1)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13, 32])
def test_int4_matches_its_integer_reference_and_stays_near_the_float_product(int4_kernel, out_features,
                                                                              in_features, rows):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features + 13)
    weight = torch.randn(out_features, in_features, generator=gen)
    weight[0] = 0  # an all-zero output feature
    weight[-1] = 0.25  # a constant one: its groups' d is 0, every weight its offset
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    x[-1, : max(1, in_features // 2)] = 0  # a group of zeros: its scale is 0
    expected = _int4_reference(x, weight)
    for b in (None, bias):
        out = Linear(weight, b, quantize="int4")(x)
        torch.testing.assert_close(out, expected if b is None else expected + b, rtol=1e-4, atol=1e-3)
        if in_features >= 32:  # 16 levels a group of 32 Gaussian weights: about 8% of the output's size (a few
            error = (out - F.linear(x, weight, b)).norm() / F.linear(x, weight, b).norm()  # outputs: up to 11%)
            assert error < 0.15, error


def test_int4_gets_back_the_4_bit_values_of_a_q4_1_weight_read_through_bfloat16(int4_kernel):
    """The default model's file is Q4_1: loaded, its weights are d * q + m rounded to bfloat16. Quantized again they
    give the file's q back, and d and m within bfloat16's rounding, so int4 serves the file's own weights."""
    gen = torch.Generator().manual_seed(3)
    n, groups = 64, 6
    q = torch.randint(0, 16, (n, groups, 32), generator=gen)
    q[..., 0], q[..., 1] = 0, 15  # Q4_1 sets m to a group's least weight and d so that its greatest is q = 15
    d = (torch.rand(n, groups, 1, generator=gen) * 0.01 + 1e-3).half().float()
    m = (-8 * d + torch.randn(n, groups, 1, generator=gen) * 1e-3).half().float()
    in_file = d * q + m
    weight = in_file.view(n, -1).bfloat16().float()
    got_q, got_d, got_m = quantize_int4(weight)
    assert torch.equal(got_q.long(), q)
    torch.testing.assert_close(got_d.float(), d.squeeze(-1), rtol=1e-2, atol=0)
    torch.testing.assert_close(got_m.float(), m.squeeze(-1), rtol=1e-2, atol=0)
    assert ((_int4_weight(weight).view(n, groups, 32) - in_file).abs() <= d / 4).all()


def test_int4_holds_five_eighths_of_a_byte_a_weight_and_refuses_what_it_cannot_run(int4_kernel):
    weight = torch.randn(64, 128)
    assert Linear(weight, quantize="int4").packed_bytes == 64 * 128 * 5 // 8
    assert Linear(torch.randn(50, 40), quantize="int4").packed_bytes == 64 * 64 * 5 // 8  # padded panel and group
    with pytest.raises(ValueError, match="float32"):
        Linear(weight.bfloat16(), quantize="int4")


@pytest.mark.parametrize("quantize", ["int8", "w8a8", "int4"])
@pytest.mark.parametrize("rows", [1, 9, 20])  # quantized by the calling thread, and by the threads
def test_a_norm_or_swiglu_done_inside_the_product_gives_what_the_separate_step_then_the_product_give(
        kernel, w8a8_kernel, int4_kernel, quantize, rows):
    from switchyard.workers.executor.fused_ops import CpuFusedOps, load_ops_kernel

    ops = CpuFusedOps(load_ops_kernel())
    gen = torch.Generator().manual_seed(rows + 7)
    hidden, inter = 72, 40
    h, norm = torch.randn(rows, hidden, generator=gen) * 3, torch.rand(hidden, generator=gen) + 0.5
    gate_up, residual = torch.randn(rows, 2 * inter, generator=gen), torch.randn(rows, 24, generator=gen)
    up_proj = Linear(torch.randn(24, hidden, generator=gen), quantize=quantize)
    down = Linear(torch.randn(24, inter, generator=gen), quantize=quantize)

    def close(fused: torch.Tensor, separate: torch.Tensor) -> None:
        # The same arithmetic in C either way; a rounding to int8 that falls the other way moves a product by a
        # 127th of its group's largest input at most.
        torch.testing.assert_close(fused, separate, rtol=1e-3, atol=5e-2)
        assert (fused - separate).norm() <= 1e-3 * separate.norm()

    close(up_proj.after_rms_norm(h, norm, 1e-5, ops), up_proj(ops.rms_norm(h, norm, 1e-5)))
    expected = residual + down(ops.silu_mul(gate_up))
    out = down.after_silu_mul(gate_up, ops, residual=residual.clone())
    close(out, expected)
