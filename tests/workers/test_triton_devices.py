"""The CUDA engine tests' CPU twins on a GPU machine: skipped there, not failed (tests/support/triton_devices.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.triton_devices import NOT_INTERPRETED

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_twins_are_skipped_where_cuda_is_present_and_triton_is_not_interpreted(tmp_path):
    """As bench/gpu_session.sh runs them on a GPU machine: ``--noconftest``, no TRITON_INTERPRET, CUDA present
    (pretended here by a plugin loaded before the test module). Triton would compile the kernels for the GPU and
    be handed CPU tensors: every CPU twin must be reported skipped with the reason, none run or fail."""
    (tmp_path / "pretend_cuda.py").write_text("import torch\ntorch.cuda.is_available = lambda: True\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--noconftest", "-p", "pretend_cuda", "-p", "no:cacheprovider", "-q", "-rs",
         "-k", "cpu", str(ROOT / "tests/workers/test_cuda_engine.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = done.stdout + done.stderr
    skipped = re.search(r"(\d+) skipped", out)
    assert skipped and int(skipped.group(1)) >= 4, out[-4000:]
    assert not re.search(r"\d+ (passed|failed|error)", out), out[-4000:]
    assert out.count(NOT_INTERPRETED.split(";")[0]) >= 1, out[-4000:]
