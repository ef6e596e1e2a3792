"""Switchyard's own processes (gateway, worker) as children: spawned by ``up`` and by the end-to-end tests.

Children run in their own session so a terminal's Ctrl-C reaches only the parent, which then stops them in
order; they also get SIGTERM if the parent dies, so a crashed parent leaves nothing behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from switchyard.deploy.processes import die_with_parent, stop_process, tail_of


class ServiceProcess:
    """One ``switchyard <command>`` child process, stopped by PID."""

    def __init__(self, name: str, args: list[str], log_path: Path | None = None,
                 env: dict[str, str] | None = None, stop_timeout_s: float = 15.0, python: str | None = None) -> None:
        """``stop_timeout_s``: how long ``stop`` lets it drain before SIGKILL (its own drain deadline and a
        margin, or a worker still finishing its requests would be killed half-way). ``python``: the interpreter
        it runs under (default: this one; a vLLM worker's is its environment's, workers/vllm_engine/environment.py)."""
        self.name = name
        self.python = python or sys.executable
        self.args = args
        self.log_path = log_path
        self.env = env
        self.stop_timeout_s = stop_timeout_s
        self._proc: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None, f"{self.name} is not started"
        return self._proc.pid

    def start(self) -> ServiceProcess:
        out = open(self.log_path, "ab") if self.log_path else None
        try:
            self._proc = subprocess.Popen(
                [self.python, "-m", "switchyard", *self.args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT if out else None,
                start_new_session=True,
                preexec_fn=die_with_parent(signal.SIGTERM),
                env={**os.environ, **(self.env or {})},
            )
        finally:
            if out:
                out.close()
        return self

    def is_running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """The exit status once it exited; None while running or never started."""
        return None if self._proc is None else self._proc.poll()

    def log_tail(self, lines: int = 40) -> str:
        return tail_of(self.log_path, lines) if self.log_path else ""

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM (graceful: finish running requests), then SIGKILL after ``timeout`` (default
        ``stop_timeout_s``); returns the exit status (None when it was not running). Idempotent."""
        proc, self._proc = self._proc, None
        stop_process(proc, signal.SIGTERM, self.stop_timeout_s if timeout is None else timeout)
        return None if proc is None else proc.returncode


def wait_until_ready(base_url: str, model: str | None, timeout_s: float, watch: list[ServiceProcess]) -> None:
    """Poll the gateway's /readyz until it is ready (and serves ``model``); fail fast if a child died."""
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    while time.monotonic() < deadline:
        for svc in watch:
            if not svc.is_running():
                raise RuntimeError(f"{svc.name} exited during start-up\n{svc.log_tail()}")
        try:
            r = httpx.get(f"{base_url}/readyz", timeout=2)
            body = r.json()
            if r.status_code == 200 and (model is None or model in body["checks"]["models"]):
                return
            last = str(body)
        except (httpx.HTTPError, ValueError) as exc:
            last = str(exc)
        time.sleep(0.2)
    raise TimeoutError(f"gateway not ready after {timeout_s:.0f} s: {last}")
