"""Child processes, stopped by PID: signals, dying with the parent, liveness, free ports, log tails.

Shared by the embedded servers (``launcher``) and Switchyard's own children (``services``).
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def stop_process(proc: subprocess.Popen | None, sig: int, timeout: float) -> None:
    """Send ``sig`` (a graceful stop), wait up to ``timeout`` s, then SIGKILL; nothing if it already ended."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def die_with_parent(sig: int):
    """A preexec_fn that makes the child receive ``sig`` when the forking thread exits.

    Resolved here, before fork, because the child must not load libraries. It runs after
    subprocess drops privileges (``user=``), which matters: a later uid change would clear it.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        if os.getppid() != parent:  # parent already gone before prctl took effect
            os.kill(os.getpid(), sig)

    return preexec


def pid_alive(pid: int) -> bool:
    """True if ``pid`` runs; a zombie (exited, not yet reaped) counts as gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail_of(path: Path, lines: int = 30) -> str:
    """The last ``lines`` lines of a log file, for error messages."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
