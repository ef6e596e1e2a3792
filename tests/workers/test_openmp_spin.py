"""The worker's OpenMP spin bound (workers/cpu_priority.py): set for libgomp before torch loads it, from the
worker's settings, never over an operator's own; too late once torch is loaded, and then said so. Each case runs in
an interpreter of its own (libgomp reads its environment once per process)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PROBE = """
import json, os, sys
{before}
from switchyard.workers.cpu_priority import bound_openmp_spin
bound_openmp_spin({count})
import torch
torch.ones(64, 64) @ torch.ones(64, 64)  # libgomp running
print(json.dumps({{k: os.environ.get(k) for k in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}}))
"""


def run_probe(count, env: dict[str, str] | None = None, before: str = "") -> tuple[dict, str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-c", PROBE.format(before=before, count=count)], capture_output=True,
                          text=True, env={**clean, **(env or {})}, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def test_the_workers_bound_is_set_before_torch_loads_libgomp():
    assert run_probe(10_000)[0] == {"GOMP_SPINCOUNT": "10000", "OMP_WAIT_POLICY": None}


@pytest.mark.parametrize("name, value", [("GOMP_SPINCOUNT", "300000"), ("OMP_WAIT_POLICY", "PASSIVE")])
def test_an_operators_own_setting_is_kept(name, value):
    env, _ = run_probe(10_000, {name: value})
    assert env[name] == value and env["GOMP_SPINCOUNT"] in (None, value)


def test_none_leaves_libgomps_default():
    assert run_probe(None)[0] == {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": None}


def test_after_torch_is_loaded_nothing_is_set_and_the_log_says_why():
    env, stderr = run_probe(10_000, before="import torch")
    assert env["GOMP_SPINCOUNT"] is None
    assert "torch was imported before the OpenMP spin could be bounded" in stderr
