"""The GPU's weight-only int8 projection (workers/executor/triton_int8.py) against the dequantized weight, on the
GPU where there is one and as a CPU twin under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from tests.support.triton_devices import DEVICES  # noqa: E402


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 96, 64), (5, 50, 72), (17, 130, 200), (40, 7, 576)])
def test_int8_linear_matches_the_dequantized_weight(device, rows, out_features, in_features):
    from switchyard.workers.executor.triton_int8 import int8_linear, quantize_int8

    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    weight[1] = 0  # an all-zero feature: scale 0
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    q, scales = quantize_int8(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and scales[1] == 0
    dequantized = q.float() * scales[:, None]
    assert ((dequantized - weight).abs() <= scales[:, None] / 2 + 1e-6).all()  # within half a step
    for b in (None, bias):
        out = int8_linear(x.to(device), q.to(device), scales.to(device), None if b is None else b.to(device))
        torch.testing.assert_close(out.cpu(), F.linear(x, dequantized, b), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_int8_linear_keeps_half_precision_activations(device):
    from switchyard.workers.executor.triton_int8 import int8_linear, quantize_int8

    weight, x = torch.randn(64, 128), torch.randn(3, 128)
    q, scales = quantize_int8(weight)
    out = int8_linear(x.half().to(device), q.to(device), scales.to(device))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), F.linear(x, q.float() * scales[:, None]), rtol=1e-2, atol=5e-2)
