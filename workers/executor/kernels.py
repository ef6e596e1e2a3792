"""The small C kernels under ``workers/executor/csrc`` (CPU, fp32): built when Switchyard is installed, loaded here.

There is no CPU paged-attention or pre-packed small-batch GEMM on PyPI for this torch (IPEX, the one package that
had them, tracks older torch releases), and a torch C++ extension costs a minute of compiling and needs ninja. A
plain C file builds in about a second with the machine's gcc and is called through ctypes, which releases the
GIL, so the worker's event loop keeps going while a kernel runs. The kernels use OpenMP; torch ships the same
``libgomp.so.1``, so both share one thread pool.

``pip install`` builds each kernel as ``_c_<name>`` beside this file (``setup.py``, optional: an install without a
compiler still succeeds); every build answers ``switchyard_build_id()``, what it was built from: the source, the flags
and, for ``-march=native``, the CPU. At run time:

    the installed build, if it was built from this source for this CPU
    else <cache>/<name>-<that identity>.so, built now (about a second) and logged as a warning
    else None, logged as a warning: the caller keeps its torch path (slower)

``-ffast-math`` lets the compiler reorder the kernels' float sums and call glibc's vector ``expf`` (only declared
under ``__FAST_MATH__``: without it SwiGLU and the prefill softmax ran at half speed). It also assumes no infinities,
so no kernel relies on one: the softmax kernels start their running maximum at ``-FLT_MAX``, not ``-INFINITY``, and
a test feeds them scores that overflow to ``-inf``.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.machinery
import logging
import os
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

log = logging.getLogger("switchyard.cpu_kernels")

KERNELS = ("paged_decode", "prefill_attention", "packed_gemm", "int8_gemm", "int4_gemm", "cpu_ops")
SOURCES = Path(__file__).with_name("csrc")
COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC", "-std=c11")
# Linked in a step of its own, without -ffast-math: gcc would link crtfastmath.o, whose constructor turns on
# flush-to-zero and denormals-are-zero for the whole process (torch and Python floats included) when it loads.
LINK_FLAGS = ("-shared", "-fopenmp", "-lm")
INSTALLED_PREFIX = "_c_"  # the installed build of <name> is the extension module _c_<name>
BUILD_ID_SOURCE = "build_id.c"  # linked into every kernel: switchyard_build_id() answers its build identity


def cache_dir() -> Path:
    """``SWITCHYARD_KERNEL_CACHE``, else the user's cache directory."""
    explicit = os.environ.get("SWITCHYARD_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "switchyard" / "kernels"


@cache
def _cpuinfo_field(name: str) -> str:
    """The first ``name: value`` line of ``/proc/cpuinfo`` (its value), "" where there is none."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    return next((line.partition(":")[2].strip() for line in lines if line.partition(":")[0].strip() == name), "")


def cpu_flags() -> str:
    """This CPU's feature flags (``/proc/cpuinfo``): a ``-march=native`` build is valid only where they match."""
    return _cpuinfo_field("flags") or _cpuinfo_field("Features")


def cpu_model() -> str:
    return _cpuinfo_field("model name")


def build_identity(name: str) -> str:
    """What a build of ``name`` depends on: its source, the shared headers, the flags and this CPU."""
    source = b"".join(p.read_bytes() for p in (SOURCES / f"{name}.c", SOURCES / BUILD_ID_SOURCE,
                                               *sorted(SOURCES.glob("*.h"))))
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
        build_id = ctypes.CDLL(str(path)).switchyard_build_id
        build_id.restype = ctypes.c_char_p
        built_as = build_id().decode()
    except (OSError, AttributeError):  # not loadable here (another CPU), or from before build ids
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


def find_compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def compile_kernel(name: str, target: Path, compiler: str, extra_flags: tuple[str, ...] = ()) -> None:
    """Build ``csrc/<name>.c`` into the shared library ``target``, atomically (concurrent builders each install a
    whole file). The one build command, used at install time (``setup.py``) and at run time alike; ``extra_flags``
    (e.g. ``-mno-avx512f``) let a test build the paths this CPU would not take."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    with tempfile.TemporaryDirectory() as objects:
        try:
            objs = []
            for source in (f"{name}.c", BUILD_ID_SOURCE):
                objs.append(str(Path(objects) / f"{Path(source).stem}.o"))
                subprocess.run([compiler, *COMPILE_FLAGS, *extra_flags,
                                f'-DSWITCHYARD_BUILD_ID="{build_identity(name)}"', "-c",
                                str(SOURCES / source), "-o", objs[-1]],
                               check=True, capture_output=True, text=True, timeout=120)
            subprocess.run([compiler, *objs, "-o", tmp, *LINK_FLAGS], check=True, capture_output=True, text=True,
                           timeout=120)
            os.chmod(tmp, 0o755)  # mkstemp makes it owner-only; a worker may run as another user
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)


def _runtime_build(name: str) -> Path | None:
    compiler = find_compiler()
    if compiler is None:
        log.warning("no C compiler found: %s.c is not built, its torch fallback is used (slower)", name)
        return None
    target = cache_dir() / f"{name}-{build_identity(name)}.so"
    if target.exists():
        return target
    log.warning("%s.c was not built at install time: building it now into %s", name, target.parent)
    try:
        compile_kernel(name, target, compiler)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("building %s.c failed, its torch fallback is used (slower): %s", name, detail)
        return None
    return target
