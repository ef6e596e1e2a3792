"""The runner's projections: the packed CPU kernel against ``F.linear``, and the fallback without it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from switchyard.workers.executor.linear import Linear, load_gemm_kernel, uses_packed_kernel

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


def test_int8_adds_into_the_residual_and_takes_strided_rows(kernel):
    weight, bias = torch.randn(50, 48), torch.randn(50)
    wide, residual = torch.randn(7, 100), torch.randn(7, 50)
    x = wide[:, 10:58]
    expected = residual + F.linear(x, _int8_reference(weight), bias)
    out = Linear(weight, bias, quantize="int8")(x, residual=residual)
    assert out is residual
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-3)


def test_int8_holds_a_quarter_of_the_bytes_and_refuses_what_it_cannot_run(kernel):
    weight = torch.randn(64, 128)
    assert Linear(weight, quantize="int8").packed_bytes == 64 * 128 + 64 * 4
    assert Linear(weight, pack=True).packed_bytes == 64 * 128 * 4
    with pytest.raises(ValueError, match="int4"):
        Linear(weight, quantize="int4")
    with pytest.raises(ValueError, match="float32"):
        Linear(weight.bfloat16(), quantize="int8")
