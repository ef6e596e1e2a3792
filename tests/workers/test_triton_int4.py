"""The GPU's 4-bit projection (workers/executor/triton_int4.py) against the dequantized weight, on the GPU where there
is one and as a CPU twin under Triton's interpreter; its bytes are GGUF's own Q4_1 blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from switchyard.workers.executor.linear import quantize_int4  # noqa: E402
from tests.support.triton_devices import DEVICES  # noqa: E402


def _dequantized(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, k: int) -> torch.Tensor:
    w = q.float() * d.float().unsqueeze(-1) + m.float().unsqueeze(-1)
    return w.reshape(q.shape[0], -1)[:, :k]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 96, 64), (5, 50, 72), (17, 130, 200), (3, 7, 576)])
def test_int4_linear_matches_the_dequantized_weight(device, rows, out_features, in_features):
    from switchyard.workers.executor.triton_int4 import int4_linear, pack_int4_rows

    gen = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, in_features, generator=gen)
    weight[1] = 0  # an all-zero feature: d 0
    bias = torch.randn(out_features, generator=gen)
    x = torch.randn(rows, in_features, generator=gen)
    q, d, m = quantize_int4(weight)
    packed = pack_int4_rows(q)
    assert packed.shape == (out_features, -(-in_features // 32) * 16) and packed.dtype == torch.uint8
    dequantized = _dequantized(q, d, m, in_features)
    for b in (None, bias):
        out = int4_linear(x.to(device), packed.to(device), d.to(device), m.to(device),
                          None if b is None else b.to(device))
        torch.testing.assert_close(out.cpu(), F.linear(x, dequantized, b), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_int4_linear_keeps_half_precision_activations(device):
    from switchyard.workers.executor.triton_int4 import int4_linear, pack_int4_rows

    weight, x = torch.randn(64, 128), torch.randn(3, 128)
    q, d, m = quantize_int4(weight)
    out = int4_linear(x.half().to(device), pack_int4_rows(q).to(device), d.to(device), m.to(device))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float().cpu(), F.linear(x, _dequantized(q, d, m, 128)), rtol=1e-2, atol=5e-2)


def test_the_packed_bytes_are_ggufs_own_q4_1_blocks():
    """What llama.cpp's Q4_1 holds for a weight (the gguf package's quantizer): each block's d, m and 16 bytes of
    nibbles, in that order. Ours from the same weight: the same bytes in the same order, d and m within a float16
    step, and so a nibble here and there one step apart (they divide by d before rounding it to float16, we
    after)."""
    gguf = pytest.importorskip("gguf")
    from switchyard.workers.executor.triton_int4 import pack_int4_rows

    weight = torch.randn(8, 96, generator=torch.Generator().manual_seed(0))
    blocks = np.frombuffer(gguf.quants.quantize(weight.numpy(), gguf.GGMLQuantizationType.Q4_1).tobytes(),
                           dtype=np.uint8).reshape(8, 3, 20)
    theirs_d = torch.from_numpy(blocks[..., 0:2].copy().view(np.float16)).squeeze(-1)
    theirs_m = torch.from_numpy(blocks[..., 2:4].copy().view(np.float16)).squeeze(-1)
    theirs_nibbles = torch.from_numpy(blocks[..., 4:].copy()).reshape(8, 48)
    q, d, m = quantize_int4(weight)
    torch.testing.assert_close(d.float(), theirs_d.float(), rtol=2e-3, atol=1e-4)
    torch.testing.assert_close(m.float(), theirs_m.float(), rtol=2e-3, atol=1e-4)
    ours = pack_int4_rows(q)
    for shift in (0, 4):  # each nibble the same, or one step apart where the two d or m rounded apart
        a, b = ((ours >> shift) & 15).int(), ((theirs_nibbles >> shift) & 15).int()
        assert (a - b).abs().max() <= 1 and (a == b).float().mean() > 0.99
