"""Builds the CPU kernels at install time; everything else is in pyproject.toml.

Each ``workers/executor/csrc/<name>.c`` becomes the shared library ``switchyard/workers/executor/_c_<name>``
(loaded with ctypes, so it needs no Python API), built by ``workers/executor/kernels.py``'s one build command. The
builds are optional: without a compiler the install still succeeds, and the worker builds or skips them at run
time (and says so in its log).
"""

import importlib.util
import subprocess
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("_switchyard_kernels", ROOT / "workers/executor/kernels.py")
kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)


class BuildKernels(build_ext):
    """Builds each kernel with the very command the worker would use at run time (``kernels.compile_kernel``), not
    the compiler flags of Python extensions. Each build carries what it was built from (source, flags, the CPU for
    ``-march=native``): a worker on another CPU, or after the source changed, builds its own at run time."""

    def build_extension(self, ext) -> None:
        name = ext.name.rsplit(".", 1)[1].removeprefix(kernels.INSTALLED_PREFIX)
        path = Path(self.get_ext_fullpath(ext.name))
        compiler = kernels.find_compiler()
        try:
            if compiler is None:
                raise OSError("no C compiler")
            kernels.compile_kernel(name, path, compiler)
        except (OSError, subprocess.SubprocessError) as exc:  # optional: the worker falls back at run time
            print(f"warning: the {name} kernel was not built ({getattr(exc, 'stderr', '') or exc}); a worker "
                  "builds it at first use or uses torch", file=sys.stderr)
            return


setup(
    ext_modules=[
        Extension(
            f"switchyard.workers.executor.{kernels.INSTALLED_PREFIX}{name}",
            sources=[f"workers/executor/csrc/{name}.c"],
            depends=[str(p.relative_to(ROOT)) for p in sorted((ROOT / "workers/executor/csrc").glob("*.h"))],
            optional=True,
        )
        for name in kernels.KERNELS
    ],
    cmdclass={"build_ext": BuildKernels},
)
