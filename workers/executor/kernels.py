"""Build and load the small C kernels under ``workers/executor/csrc`` (CPU, fp32), once per machine.

There is no CPU paged-attention or pre-packed small-batch GEMM on PyPI for this torch (IPEX, the one package that
had them, tracks older torch releases), and a torch C++ extension costs a minute of compiling and needs ninja. A
plain C file builds in about a second with the gcc the machine has and is called through ctypes, which releases the
GIL, so the worker's event loop keeps going while a kernel runs. The kernels use OpenMP; torch ships the same
``libgomp.so.1``, so both share one thread pool.

    <cache>/<name>-<hash of source, flags and CPU>.so     built once per machine, renamed into place

Nothing here is required: where there is no compiler or a build fails, ``load_library`` answers None (and logs why)
and callers keep their torch-only path.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("switchyard.cpu_kernels")

SOURCES = Path(__file__).with_name("csrc")
CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-shared", "-std=c11")


def cache_dir() -> Path:
    """``SWITCHYARD_KERNEL_CACHE``, else the user's cache directory."""
    explicit = os.environ.get("SWITCHYARD_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "switchyard" / "kernels"


def _cpu_flags() -> str:
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


@cache
def load_library(name: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` compiled and loaded, building it if needed; None (logged) where it cannot be had."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found: %s.c is not built, its torch fallback is used (slower)", name)
        return None
    source_path = SOURCES / f"{name}.c"
    # Headers are part of every build's identity: a changed shared tile rebuilds each kernel that includes it.
    source = source_path.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    # -march=native: the library is only valid for this CPU, so the CPU's flags are part of its name.
    key = hashlib.sha256(source + " ".join(CFLAGS).encode() + _cpu_flags().encode()).hexdigest()[:16]
    target = cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
            os.close(fd)
            try:
                subprocess.run([compiler, *CFLAGS, str(source_path), "-o", tmp, "-lm"], check=True,
                               capture_output=True, text=True, timeout=120)
                os.replace(tmp, target)  # atomic: concurrent builders each install a whole file
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or exc
            log.warning("building %s.c failed, its torch fallback is used (slower): %s", name, detail)
            return None
    return ctypes.CDLL(str(target))
