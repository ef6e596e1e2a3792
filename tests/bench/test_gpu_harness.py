"""The GPU harness (bench/gpu.py) runs end to end on the CPU, so that it cannot rot between GPU sessions: every part,
every check, a tiny model of the same shape family, the Triton kernels interpreted (see its ``--dry-run``); and
every Triton kernel compiles for real GPUs (``--compile-only``), which the interpreter never shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytest.importorskip("triton")


def rehearse(call: str, tmp_path: Path) -> tuple[str, Path]:
    """``bench/gpu_session.sh CALL`` as GPU_SESSION.md runs it, rehearsed on this CPU: its parts through
    ``bench/gpu.py --dry-run``, its tests as collected without a GPU. Returns the call's output and its $OUT."""
    out = tmp_path / call
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(GPU_REHEARSAL="1", GPU_PYTHON=sys.executable, GPU_SITE=str(tmp_path / "site"),
               GPU_STASH=str(tmp_path / "stash"), OUT=str(out))
    done = subprocess.run(["bash", str(ROOT / "bench/gpu_session.sh"), call], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    text = done.stdout + done.stderr
    assert done.returncode == 0, text[-6000:]
    return text, out


def test_the_two_gpu_calls_pass_every_check_of_every_part_rehearsed_on_the_cpu(tmp_path):
    """Between them the two calls run every part of bench/gpu.py (here ``--dry-run``), each writing its section
    and checks into $OUT, after the carried site's import check; call one runs the GPU tests first (collected
    here, as the GPU machine collects them: no conftest, the checkout mapped as the package)."""
    text, out = rehearse("one", tmp_path)
    assert "check-imports: ok" in text
    collected = re.search(r"^(\d+) tests collected in [\d.]+s", text, re.MULTILINE)
    assert collected and int(collected.group(1)) >= 20, text[-6000:]
    assert not re.search(r"^ERROR|\d+ errors? in ", text, re.MULTILINE), text[-6000:]
    section = (out / "gpu-device-decode-prefill-tiny-dry-run.md").read_text()
    for table in ("Measured: copy bandwidth", "Decode step", "Prefill of one prompt",
                  "Greedy the tiny ChatML model on"):
        assert table in section
    assert "the run had not finished" not in section
    # What a GPU session needs from the run's own words: the replay check compares numbers, not nothing.
    assert "CUDA-graph replay equals eager | pass | largest relative difference" in section
    checks = (out / "gpu-device-decode-prefill-tiny-dry-run.checks.txt").read_text()
    assert checks.startswith("checks: 5 passed, 0 failed"), checks
    assert (out / "gpu-one.log").read_text().count("== ") >= 3

    text, out = rehearse("two", tmp_path)
    section = (out / "gpu-smollm2-serving-dry-run.md").read_text()
    for table in ("Continuous batching vs HF", "Greedy the tiny ChatML model (dry run)"):
        assert table in section
    checks = (out / "gpu-smollm2-serving-dry-run.checks.txt").read_text()
    assert checks.startswith("checks: 3 passed, 0 failed"), checks


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
    # What a GPU call cut off at its limit returns: the parts so far, marked unfinished.
    report.save(tmp_path, "gpu-x", final=False)
    assert "prefill ran" in (tmp_path / "gpu-x.md").read_text()
    assert "the run had not finished" in (tmp_path / "gpu-x.md").read_text()
    assert (tmp_path / "gpu-x.checks.txt").read_text().startswith("checks: 1 passed, 1 failed")


def test_every_triton_kernel_compiles_for_sm80_and_sm90_without_a_gpu(tmp_path):
    """``--compile-only``: each kernel, in each dtype the engine serves, at every family's head shapes (attention)
    and layer sizes (the int8 and int4 projections, with a bias and without), compiled through ptxas for both targets
    (and within their shared memory), as a GPU's first launch would compile it."""
    from bench.triton_aot import DTYPES, FAMILIES, KERNELS, LINEAR_KERNELS, TARGETS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(ROOT / "bench/gpu.py"), "--compile-only", "--out", str(tmp_path)],
                          cwd=ROOT, env={**env, "PYTHONUNBUFFERED": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-6000:]
    section = (tmp_path / "gpu-compile-only.md").read_text()
    total = len(FAMILIES) * len(DTYPES) * len(TARGETS) * (len(KERNELS) + 2 * len(LINEAR_KERNELS))
    assert f"{total} kernels compiled in" in section and ", 0 failed" in section, section[-3000:]
    rows = {tuple(cell.strip() for cell in line.split("|")[1:5]) for line in section.splitlines()
            if line.startswith("| ") and line.endswith("| ok |")}
    assert rows == {(family, str(dtype).removeprefix("torch."), target, kernel.strip("_")) for family in FAMILIES
                    for dtype in DTYPES for target in TARGETS for kernel in KERNELS + LINEAR_KERNELS}
