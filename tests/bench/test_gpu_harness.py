"""The GPU harness (bench/gpu.py) runs end to end on the CPU, so that it cannot rot between GPU sessions: every part,
every check, a tiny model of the same shape family, the Triton kernels interpreted (see its ``--dry-run``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")


def test_dry_run_passes_every_check_of_every_part(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONUNBUFFERED": "1"}
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu.py"), "--dry-run", "--out", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    section = (tmp_path / "gpu-device-decode-prefill-serving-smollm2-dry-run.md").read_text()
    for table in ("Measured: copy bandwidth", "Decode step", "Prefill of one prompt", "Continuous batching vs HF",
                  "Greedy the tiny ChatML model"):
        assert table in section
    checks = (tmp_path / "gpu-device-decode-prefill-serving-smollm2-dry-run.checks.txt").read_text()
    assert checks.startswith("checks: 7 passed, 0 failed"), checks
    # What a GPU session needs from the run's own words: the replay check compares numbers, not nothing.
    assert "CUDA-graph replay equals eager | pass | largest relative difference" in section


def test_a_failed_check_fails_the_run_but_not_the_other_parts(tmp_path, monkeypatch):
    from bench import gpu_parts

    report = gpu_parts.Report("## test", dry_run=True)
    monkeypatch.setitem(gpu_parts.PARTS, "device", lambda profile, report: 1 / 0)
    monkeypatch.setitem(gpu_parts.PARTS, "prefill", lambda profile, report: report.check("prefill ran", True))
    gpu_parts.run_part("device", None, report)
    gpu_parts.run_part("prefill", None, report)
    assert not report.all_passed
    assert [name for name, _, _ in report.checks] == ["device: runs to its end", "prefill ran"]
    assert "**FAIL**" in report.markdown()
