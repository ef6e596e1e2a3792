"""The fused CPU kernels for the runner's elementwise steps against the torch reference."""

from __future__ import annotations

import pytest
import torch

from switchyard.workers.executor.fused_ops import CpuFusedOps, TorchOps, load_ops_kernel, make_ops

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def fused(compiled):
    return CpuFusedOps(compiled(load_ops_kernel, "csrc/cpu_ops.c"))


# 3 rows stay on one thread; 300 x 576 rows are split over threads.
@pytest.mark.parametrize("rows,dim", [(3, 64), (300, 576)])
def test_rms_norm(fused, rows, dim):
    gen = torch.Generator().manual_seed(rows)
    x, weight = torch.randn(rows, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    torch.testing.assert_close(fused.rms_norm(x, weight, 1e-5), TorchOps().rms_norm(x, weight, 1e-5))
    wide = torch.randn(rows, dim + 8, generator=gen)[:, 4 : dim + 4]  # a strided view reads right
    torch.testing.assert_close(fused.rms_norm(wide, weight, 1e-5), TorchOps().rms_norm(wide, weight, 1e-5))


@pytest.mark.parametrize("rows,inter", [(2, 24), (200, 1536)])
def test_silu_mul(fused, rows, inter):
    gate_up = torch.randn(rows, 2 * inter, generator=torch.Generator().manual_seed(inter)) * 4
    torch.testing.assert_close(fused.silu_mul(gate_up), TorchOps().silu_mul(gate_up))


@pytest.mark.parametrize("rows", [1, 5, 400])
def test_rotary_in_place_matches_reference(fused, rows):
    heads, kv_heads, d = 9, 3, 64
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * d, generator=gen)
    angles = torch.rand(rows, d // 2, generator=gen) * 100
    cos, sin = angles.cos(), angles.sin()
    expected = TorchOps().rotary(qkv, heads + kv_heads, d, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * d :].clone()

    got = fused.rotary(qkv, heads + kv_heads, d, cos, sin)

    torch.testing.assert_close(got, expected)
    assert got.data_ptr() == qkv.data_ptr()  # rotated where it lies: q and k stay views of qkv
    assert torch.equal(qkv[:, (heads + kv_heads) * d :], v_before)  # v untouched


def test_make_ops_picks_fused_for_cpu_fp32_only(fused):
    assert isinstance(make_ops(CPU, torch.float32), CpuFusedOps)
    assert type(make_ops(CPU, torch.bfloat16)) is TorchOps


def test_no_compiler_means_torch_ops(no_compiler, caplog):
    assert type(make_ops(CPU, torch.float32)) is TorchOps
    assert "cpu_ops.c" in caplog.text
