"""Builds the CPU kernels at install time; everything else is in pyproject.toml.

Each ``workers/executor/csrc/<name>.c`` becomes the shared library ``switchyard/workers/executor/_c_<name>``
(loaded with ctypes, so it needs no Python API), built with the flags ``workers/executor/kernels.py`` owns. The
builds are optional: without a compiler the install still succeeds, and the worker builds or skips them at run
time (and says so in its log).
"""

import importlib.util
import json
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
_spec = importlib.util.spec_from_file_location("_switchyard_kernels", ROOT / "workers/executor/kernels.py")
kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernels)


class BuildKernels(build_ext):
    """Also records what each kernel was built from (source, flags, CPU for ``-march=native``): a worker on another
    CPU, or after the source changed, builds its own at run time."""

    def run(self) -> None:
        super().run()
        built = {}
        for ext in self.extensions:
            path = Path(self.get_ext_fullpath(ext.name))
            if path.exists():
                built[ext.name.rsplit(".", 1)[1].removeprefix(kernels.INSTALLED_PREFIX)] = path.parent
        for name, folder in built.items():
            record = folder / kernels.BUILT_FOR
            identities = json.loads(record.read_text()) if record.exists() else {}
            record.write_text(json.dumps({**identities, name: kernels.build_identity(name)}, indent=1) + "\n")


setup(
    ext_modules=[
        Extension(
            f"switchyard.workers.executor.{kernels.INSTALLED_PREFIX}{name}",
            sources=[f"workers/executor/csrc/{name}.c"],
            depends=[str(p.relative_to(ROOT)) for p in sorted((ROOT / "workers/executor/csrc").glob("*.h"))],
            extra_compile_args=list(kernels.COMPILE_FLAGS),
            extra_link_args=list(kernels.LINK_FLAGS),
            optional=True,
        )
        for name in kernels.KERNELS
    ],
    cmdclass={"build_ext": BuildKernels},
)
