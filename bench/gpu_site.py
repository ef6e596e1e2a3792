"""Make this checkout importable as ``switchyard`` under a folder (the GPU machine's /tmp/site), without pip.

pyproject.toml maps the repository's top-level folders onto ``switchyard.*`` (package-dir); an editable install
needs the build backend and its network-free setup, so on a machine that only runs the engine the same mapping is
made with links. Python 3.11+ (tomllib).
"""

from __future__ import annotations

import shutil
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(site: Path) -> None:
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    package = site / "switchyard"
    if package.exists() or package.is_symlink():
        shutil.rmtree(package) if package.is_dir() and not package.is_symlink() else package.unlink()
    package.mkdir(parents=True)
    root_dir = ROOT / mapping.pop("switchyard")
    for entry in root_dir.iterdir():  # the root package's own modules (cli, __init__, ...)
        (package / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        (package / name.removeprefix("switchyard.")).symlink_to(ROOT / folder)
    print(f"switchyard -> {ROOT} under {site}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
