"""``make test``'s type check: mypy over the package as it is installed, ``switchyard.<folder>``.

The repository's folders become one import name only through ``[tool.setuptools.package-dir]`` (an editable
install maps them with an import hook, which mypy cannot follow), so this lays the same map out as symbolic links
under ``build/typecheck/`` and runs mypy there with ``[tool.mypy]`` from pyproject.toml. Findings name the files as
``switchyard/<folder>/...``.

    python tests/typecheck.py [mypy arguments]
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TREE = ROOT / "build" / "typecheck"


def lay_out_tree() -> Path:
    """``build/typecheck/switchyard/``: a link per mapped folder, and the ``switchyard`` folder's own entries."""
    package_dir = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    shutil.rmtree(TREE, ignore_errors=True)
    package = TREE / "switchyard"
    package.mkdir(parents=True)
    for entry in (ROOT / package_dir["switchyard"]).iterdir():
        if entry.name != "__pycache__":
            (package / entry.name).symlink_to(entry)
    for name, folder in package_dir.items():
        if name != "switchyard":
            (package / name.removeprefix("switchyard.")).symlink_to(ROOT / folder)
    return TREE


def main(argv: list[str]) -> int:
    tree = lay_out_tree()
    command = [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
               "--cache-dir", str(ROOT / "build" / "mypy-cache"), "-p", "switchyard", *argv]
    return subprocess.run(command, cwd=tree, env={**os.environ, "MYPYPATH": ""}).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
