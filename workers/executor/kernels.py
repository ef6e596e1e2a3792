"""The small C kernels under ``workers/executor/csrc`` (CPU, fp32): built when Switchyard is installed, loaded here.

There is no CPU paged-attention or pre-packed small-batch GEMM on PyPI for this torch (IPEX, the one package that
had them, tracks older torch releases), and a torch C++ extension costs a minute of compiling and needs ninja. A
plain C file builds in about a second with the machine's gcc and is called through ctypes, which releases the
GIL, so the worker's event loop keeps going while a kernel runs. The kernels use OpenMP; torch ships the same
``libgomp.so.1``, so both share one thread pool.

``pip install`` builds each kernel as ``_c_<name>`` beside this file (``setup.py``, optional: an install without a
compiler still succeeds) and records what it was built from: the source, the flags and, for ``-march=native``, the
CPU. At run time:

    the installed build, if it was built from this source for this CPU
    else <cache>/<name>-<that identity>.so, built now (about a second) and logged as a warning
    else None, logged as a warning: the caller keeps its torch path (slower)

``-ffast-math`` lets the compiler reorder the kernels' float sums; ``-fno-finite-math-only`` keeps infinities
meaningful, since the softmax kernels start their running maximum at ``-INFINITY``.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import json
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("switchyard.cpu_kernels")

KERNELS = ("paged_decode", "prefill_attention", "packed_gemm", "cpu_ops")
SOURCES = Path(__file__).with_name("csrc")
# -fno-wrapv undoes the -fwrapv Python adds to extension builds, which keeps gcc from vectorising some index math.
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fno-finite-math-only", "-fno-wrapv", "-fopenmp", "-std=c11")
LINK_FLAGS = ("-fopenmp", "-lm")
INSTALLED_PREFIX = "_c_"  # the installed build of <name> is the extension module _c_<name>
BUILT_FOR = "_c_kernels.json"  # beside the installed builds: {name: build identity}


def cache_dir() -> Path:
    """``SWITCHYARD_KERNEL_CACHE``, else the user's cache directory."""
    explicit = os.environ.get("SWITCHYARD_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "switchyard" / "kernels"


def cpu_flags() -> str:
    """This CPU's feature flags (``/proc/cpuinfo``): a ``-march=native`` build is valid only where they match."""
    try:
        return next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        return ""


def build_identity(name: str) -> str:
    """What a build of ``name`` depends on: its source, the shared headers, the flags and this CPU."""
    source = (SOURCES / f"{name}.c").read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCES.glob("*.h")))
    flags = " ".join((*COMPILE_FLAGS, *LINK_FLAGS)).encode()
    return hashlib.sha256(source + flags + cpu_flags().encode()).hexdigest()[:16]


def installed_library(name: str) -> Path | None:
    """The build made at install time, where it was made from this source for this CPU."""
    here = Path(__file__).parent
    built = [here / f"{INSTALLED_PREFIX}{name}{suffix}" for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in built if p.exists()), None)
    if path is None:
        return None
    try:
        built_as = json.loads((here / BUILT_FOR).read_text()).get(name)
    except (OSError, ValueError):
        built_as = None
    if built_as != build_identity(name):
        log.warning("the installed %s kernel was built from another source or for another CPU", name)
        return None
    return path


@cache
def load_library(name: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` loaded: the installed build, else one built now; None (logged) where neither can be."""
    path = installed_library(name)
    if path is None:
        path = _runtime_build(name)
    return None if path is None else ctypes.CDLL(str(path))


def _runtime_build(name: str) -> Path | None:
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        log.warning("no C compiler found: %s.c is not built, its torch fallback is used (slower)", name)
        return None
    source_path = SOURCES / f"{name}.c"
    target = cache_dir() / f"{name}-{build_identity(name)}.so"
    if target.exists():
        return target
    log.warning("%s.c was not built at install time: building it now into %s", name, target.parent)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            subprocess.run([compiler, *COMPILE_FLAGS, "-fPIC", "-shared", str(source_path), "-o", tmp, *LINK_FLAGS],
                           check=True,
                           capture_output=True, text=True, timeout=120)
            os.replace(tmp, target)  # atomic: concurrent builders each install a whole file
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building %s.c failed, its torch fallback is used (slower): %s", name, detail)
        return None
    return target
