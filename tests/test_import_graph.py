"""The rooms' arrows point one way: the HTTP edge (gateway) and the durable consumers (jobs) sit on the domain room,
and nothing below the edge reaches back up into it.

    gateway ─┐          workers ─┐
    jobs ────┴─▶ domain ─┴────────┴─▶ shared, scheduler
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# folder -> the rooms it must not import from
FORBIDDEN = {
    "domain": ("gateway", "jobs", "workers", "deploy"),
    "jobs": ("gateway", "workers", "deploy"),
    "workers": ("gateway", "jobs", "domain", "deploy"),
    "scheduler": ("gateway", "jobs", "domain", "workers", "shared", "deploy"),
    "shared": ("gateway", "jobs", "domain", "workers", "deploy"),
}


def imported_modules(path: Path) -> set[str]:
    """The absolute module names a module imports, wherever in the module (lazy imports too)."""
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        modules |= set([a.name for a in node.names] if isinstance(node, ast.Import) else
                       [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
    return modules


def imported_rooms(path: Path, package: str = "switchyard") -> set[str]:
    """The ``<package>.<room>`` packages a module imports."""
    depth = package.count(".") + 1
    return {n.split(".")[depth] for n in imported_modules(path)
            if n.startswith(package + ".") and n.count(".") >= depth}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_arrow_runs_back_up(folder):
    wrong = {f"{p.relative_to(ROOT)} imports switchyard.{room}"
             for p in (ROOT / folder).rglob("*.py") for room in imported_rooms(p) & set(FORBIDDEN[folder])}
    assert not wrong, sorted(wrong)


# Inside workers/: each engine builds on what serving/ shares, never on the other engine, and none on the worker
# service that drives it (workers/serving/interface.py is the boundary).
ENGINE_ROOMS = {
    "serving": ("engine", "vllm_engine", "service"),
    "engine": ("vllm_engine", "service"),
    "vllm_engine": ("engine", "service"),
}


@pytest.mark.parametrize("room", sorted(ENGINE_ROOMS))
def test_each_engine_builds_on_serving_never_on_the_other(room):
    wrong = {f"{p.relative_to(ROOT)} imports switchyard.workers.{other}"
             for p in (ROOT / "workers" / room).rglob("*.py") for other in imported_rooms(p, "switchyard.workers")
             & set(ENGINE_ROOMS[room])}
    assert not wrong, sorted(wrong)
