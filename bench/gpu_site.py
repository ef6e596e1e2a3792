"""The GPU machine's Python site for bench/GPU_SESSION.md: what is carried there, mapped and checked before any
GPU time is spent on a part.

    python3 bench/gpu_site.py check-carry .gpu/wheels SPEC...   # here, after bench/gpu_carry.sh downloads
    python3 bench/gpu_site.py map /tmp/site                     # there: this checkout as ``switchyard``
    python3 bench/gpu_site.py check-imports /tmp/site           # there: every carried requirement met, every
                                                                #   module of the engine's path imported

``map``: pyproject.toml maps the repository's top-level folders onto ``switchyard.*`` (package-dir); an editable
install needs the build backend and its network-free setup, so on a machine that only runs the engine the same
mapping is made with links. Python 3.11+ (tomllib).
"""

from __future__ import annotations

import importlib
import shutil
import sys
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What the GPU image has (.library/device/KINDS.md, read 2026-11), by normalised name: the versions sessions read
# there, and, for a few packages nobody read, a floor they certainly pass (released years before the image). A
# carried wheel's requirement on anything else, or on a newer version, must be carried too: pydantic needs
# typing-extensions>=4.16, and the image's typing-extensions is of unknown age.
IMAGE = {
    "torch": "2.11.0", "triton": "3.6.0", "transformers": "5.17.0", "tokenizers": "0.23.2", "numpy": "2.5.2",
    "safetensors": "0.8.0", "accelerate": "1.15.0", "huggingface-hub": "1.33.0",
    "pyyaml": "6.0", "requests": "2.28", "tqdm": "4.60",
}

# The modules a GPU call imports: the engine's path, the benchmark and the tests it runs (their helpers included).
ENGINE_PATH = (
    "msgspec", "pydantic", "pydantic_settings", "llguidance", "gguf", "transformers", "triton",
    "switchyard.shared.config", "switchyard.shared.messages", "switchyard.workers.engine.engine",
    "switchyard.workers.engine.sampling", "switchyard.workers.serving.guided",
    "switchyard.workers.executor.cuda_graphs",
    "switchyard.workers.executor.attention.triton_kernels", "switchyard.workers.model_store",
    "bench.gpu_parts", "bench.triton_aot", "tests.support.tiny_model", "tests.support.id_tokenizer",
    "tests.support.triton_devices",
)


def _packaging():
    try:
        from packaging.requirements import Requirement
        from packaging.utils import canonicalize_name
    except ImportError:  # pip's own copy, where packaging is not installed
        from pip._vendor.packaging.requirements import Requirement
        from pip._vendor.packaging.utils import canonicalize_name
    return Requirement, canonicalize_name


def wheel_metadata(wheel: Path) -> tuple[str, str, list[str]]:
    """(name, version, requirements that apply without extras) of a wheel file."""
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        meta = Parser().parsestr(zf.read(name).decode())
    return meta["Name"], meta["Version"], meta.get_all("Requires-Dist") or []


def unmet(requirements: dict[str, list[str]], available: dict[str, str]) -> list[str]:
    """Each requirement (of the named package) that no available version (by normalised name) satisfies."""
    Requirement, canonicalize_name = _packaging()
    problems = []
    for owner, reqs in requirements.items():
        for text in reqs:
            req = Requirement(text)
            if req.marker is not None and not req.marker.evaluate({"extra": "", "python_version": "3.12"}):
                continue
            have = available.get(canonicalize_name(req.name))
            if have is None:
                problems.append(f"{owner} needs {text}: neither carried nor known in the GPU image")
            elif req.specifier and not req.specifier.contains(have, prereleases=True):
                problems.append(f"{owner} needs {text}: {have} is there")
    return problems


def check_carry(folder: Path, specs: list[str]) -> list[str]:
    """Every pinned ``name==version`` has its wheel in ``folder``, and every wheel's requirements are carried or
    in the image (``IMAGE``); returns what is wrong."""
    _, canonicalize_name = _packaging()
    carried, requirements = {}, {}
    for wheel in sorted(folder.glob("*.whl")):
        name, version, reqs = wheel_metadata(wheel)
        carried[canonicalize_name(name)] = version
        requirements[f"{name} {version}"] = reqs
    problems = []
    for spec in specs:
        name, _, version = spec.partition("==")
        if carried.get(canonicalize_name(name)) != version:
            problems.append(f"{spec}: no wheel of it in {folder}")
    available = {canonicalize_name(k): v for k, v in IMAGE.items()} | carried
    return problems + unmet(requirements, available)


def check_site(site: Path, path: list[str] | None = None) -> list[str]:
    """The requirements of every package installed in ``site`` (the carried wheels), each met by the version that
    imports from ``path`` (default ``sys.path``: the site first, then the image); returns what is not."""
    from importlib import metadata

    _, canonicalize_name = _packaging()
    installed: dict[str, str] = {}
    for dist in metadata.distributions(path=path if path is not None else sys.path):
        # in path order: the first of a name is the one that imports
        installed.setdefault(canonicalize_name(dist.metadata["Name"]), dist.version)
    requirements = {f"{d.metadata['Name']} {d.version}": d.requires or []
                    for d in metadata.distributions(path=[str(site)])}
    return unmet(requirements, installed)


def check_imports() -> list[str]:
    """Every module of ``ENGINE_PATH`` imports; returns what did not, and why."""
    problems = []
    for module in ENGINE_PATH:
        try:
            importlib.import_module(module)
        except Exception as exc:  # noqa: BLE001 - whatever stops the import is what the call must print
            problems.append(f"import {module}: {type(exc).__name__}: {exc}")
    return problems


def map_checkout(site: Path) -> None:
    """Link this checkout's folders under ``site/switchyard`` as pyproject.toml's package-dir maps them."""
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


def main(argv: list[str]) -> int:
    command, *rest = argv or ["?"]
    if command == "map" and len(rest) == 1:
        map_checkout(Path(rest[0]))
        return 0
    if command == "check-carry" and rest:
        problems = check_carry(Path(rest[0]), rest[1:])
    elif command == "check-imports" and len(rest) <= 1:
        # As bench/gpu.py: this folder off the path (its kernels.py would shadow the `kernels` package that
        # transformers tries), the root appended after the mapped site, for `bench` and `tests`.
        sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT / "bench"] + [str(ROOT)]
        problems = (check_site(Path(rest[0])) if rest else []) + check_imports()
    else:
        print(__doc__)
        return 2
    for problem in problems:
        print(f"FAILED {problem}")
    print(f"{command}: {'ok' if not problems else f'{len(problems)} problems'}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
