"""The fenced blocks of the documentation that a test runs: each is preceded, on the line before its fence, by the
marker ``<!-- runs-here -->`` (docs/development.md says when a block may carry it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

MARKER = "<!-- runs-here -->"
ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r"^(?P<fence>`{3,}|~{3,})\s*(?P<lang>[\w-]*)")


@dataclass(frozen=True)
class MarkedBlock:
    """One marked block: where it is (``line``: its opening fence, 1-based), its language and its text."""

    path: str
    line: int
    lang: str
    code: str

    @property
    def name(self) -> str:
        """``docs/getting-started.md:42``: the test's id, the place to look when it fails."""
        return f"{self.path}:{self.line}"


def documentation_files(root: Path = ROOT) -> list[Path]:
    """README.md and every page under docs/, in a stable order."""
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def marked_blocks(path: Path, root: Path = ROOT) -> list[MarkedBlock]:
    """The marked blocks of one Markdown file. A marker not followed by a fence is an error, so that a marker
    cannot drift away from its block unnoticed."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() != MARKER:
            i += 1
            continue
        opening = _FENCE.match(lines[i + 1]) if i + 1 < len(lines) else None
        if opening is None:
            raise ValueError(f"{path.relative_to(root)}:{i + 1}: {MARKER} is not followed by a fenced block")
        fence, start = opening["fence"], i + 1
        end = next((j for j in range(start + 1, len(lines)) if lines[j].strip() == fence), None)
        if end is None:
            raise ValueError(f"{path.relative_to(root)}:{start + 1}: the marked block is never closed")
        blocks.append(MarkedBlock(str(path.relative_to(root)), start + 1, opening["lang"],
                                  "\n".join(lines[start + 1:end]) + "\n"))
        i = end + 1
    return blocks


def all_marked_blocks(root: Path = ROOT) -> list[MarkedBlock]:
    """Every marked block of README.md and docs/."""
    return [block for path in documentation_files(root) for block in marked_blocks(path, root)]
