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
