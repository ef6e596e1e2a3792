"""A non-editable install: ``switchyard`` is the only top-level import name, and it runs from the install alone."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from switchyard.workers.executor.kernels import KERNELS

ROOT = Path(__file__).resolve().parents[1]
MAPPED_FOLDERS = ("switchyard", "gateway", "domain", "jobs", "workers", "scheduler", "shared", "migrations", "deploy")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: setuptools writes build/ and *.egg-info next to the sources.
    src = tmp_path_factory.mktemp("src")
    for name in (*MAPPED_FOLDERS, "pyproject.toml", "setup.py", "README.md"):
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True)
    (wheel,) = out.glob("switchyard-*.whl")
    return wheel


def test_the_wheel_installs_one_top_level_name_with_its_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {"switchyard"}
    assert "switchyard/migrations/0001_requests.sql" in names
    assert "switchyard/workers/executor/csrc/paged_decode.c" in names
    assert "switchyard/workers/executor/csrc/gemm_tile.h" in names
    if shutil.which("gcc") or shutil.which("cc"):  # the kernels are built at install time where they can be
        assert {f"switchyard/workers/executor/_c_{name}" for name in KERNELS} <= {n.split(".")[0] for n in names}
    # Every Python file of the mapped folders is in the wheel: a subpackage missing from pyproject's list would
    # install without its modules.
    sources = {f"{'switchyard' if folder == 'switchyard' else 'switchyard/' + folder}/{p.relative_to(ROOT / folder)}"
               for folder in MAPPED_FOLDERS for p in (ROOT / folder).rglob("*.py")}
    assert sources - set(names) == set()


def test_every_module_imports_from_the_install_alone(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target),
                    str(wheel)], check=True, capture_output=True)
    # Outside the checkout, with the install first on the path: nothing can come from the source tree.
    code = ("import pkgutil, sys\n"
            # The editable install of the checkout would fill in what the wheel lacks: take its finder away.
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in getattr(f, '__module__', '')]\n"
            "import switchyard\n"
            "for m in pkgutil.walk_packages(switchyard.__path__, 'switchyard.'):\n"
            # _c_*: the C kernels, loaded with ctypes rather than imported
            "    if m.name != 'switchyard.__main__' and not m.name.rsplit('.', 1)[1].startswith('_c_'):\n"
            "        __import__(m.name)\n"
            "outside = [n for n, m in sys.modules.items() if n.split('.')[0] == 'switchyard'\n"
            f"           and not (m.__file__ or '').startswith({str(target)!r})]\n"
            "assert not outside, outside\n")
    env = {**os.environ, "PYTHONPATH": str(target)}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path, env=env)
    help_text = subprocess.run([sys.executable, "-m", "switchyard", "--help"], check=True, cwd=tmp_path, env=env,
                               capture_output=True, text=True).stdout
    assert "usage: switchyard" in help_text and "jobs" in help_text
