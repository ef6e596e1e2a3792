"""Where a test of the Triton kernels runs: on the GPU where there is one, and as a CPU twin where Triton is
interpreted.

Triton reads ``TRITON_INTERPRET`` once, at its import: tests/conftest.py sets it where there is no GPU, so that CI
runs the kernels on CPU tensors. Where it is not set (a GPU machine, or ``pytest --noconftest`` as
bench/gpu_session.sh runs), Triton compiles for the GPU and a CPU tensor handed to a kernel fails the launch
("Pointer argument cannot be accessed from Triton"): there a CPU twin is skipped, it would test nothing of the GPU.
"""

from __future__ import annotations

import os

import pytest
import torch


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on CPU tensors) in this process."""
    return os.environ.get("TRITON_INTERPRET") == "1"


NOT_INTERPRETED = ("a CPU twin runs where Triton is interpreted (TRITON_INTERPRET=1); here Triton compiles for a GPU "
                   "and cannot take CPU tensors")
CUDA = pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"))
CPU_TWIN = pytest.param("cpu", marks=pytest.mark.skipif(not interpreted(), reason=NOT_INTERPRETED))
DEVICES = [CUDA, CPU_TWIN]
