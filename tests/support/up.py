"""``switchyard up`` run as an operator runs it, for the end-to-end tests of the one command: in a data dir of its
own (embedded NATS and Postgres, the run file, the default key), stopped by PID and its dir removed."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from tests.support.system import free_port


@dataclass
class Up:
    base_url: str
    api_key: str
    data_dir: Path

    @property
    def urls(self) -> dict:
        """The run file's URLs (NATS's and Postgres's, with their credentials)."""
        return json.loads((self.data_dir / "run.json").read_text())


@contextlib.contextmanager
def running_up(args: list[str] | Callable[[Path], list[str]], models: list[str], timeout_s: float = 300,
               ) -> Iterator[Up]:
    """``switchyard up`` with ``args`` (or ``args(data_dir)``; ``--data-dir`` and ``--port`` are its own), once
    ``/v1/models`` lists ``models``; SIGTERM at the end (up stops its children in order), SIGKILL to its group
    after a minute."""
    data = Path(tempfile.mkdtemp(prefix="switchyard-up-"))
    data.chmod(0o755)  # Postgres runs as nobody under root: it must enter the data dir
    port = free_port()
    log = open(data / "up.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "switchyard", "up", "--data-dir", str(data), "--port", str(port),
                             *(args(data) if callable(args) else args)],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        yield Up(base, _wait_ready(proc, data, base, models, timeout_s), data)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        log.close()
        subprocess.run(["rm", "-rf", str(data)], check=False)


def _wait_ready(proc, data: Path, base: str, models: list[str], timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    key_file = data / "default-api-key"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"switchyard up exited:\n{(data / 'up.log').read_text()[-4000:]}")
        if key_file.exists():
            key = key_file.read_text().strip()
            try:
                listed = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {key}"}, timeout=5)
                if listed.status_code == 200 and set(models) <= {m["id"] for m in listed.json()["data"]}:
                    return key
            except httpx.HTTPError:
                pass
        time.sleep(0.5)
    raise AssertionError(f"switchyard up not ready in {timeout_s} s:\n{(data / 'up.log').read_text()[-4000:]}")
