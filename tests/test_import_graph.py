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


def imported_rooms(path: Path) -> set[str]:
    """The ``switchyard.<room>`` packages a module imports, wherever in the module (lazy imports too)."""
    rooms = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
        rooms |= {n.split(".")[1] for n in names if n.startswith("switchyard.") and n.count(".") >= 1}
    return rooms


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_arrow_runs_back_up(folder):
    wrong = {f"{p.relative_to(ROOT)} imports switchyard.{room}"
             for p in (ROOT / folder).rglob("*.py") for room in imported_rooms(p) & set(FORBIDDEN[folder])}
    assert not wrong, sorted(wrong)
