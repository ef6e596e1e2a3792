"""Where the benchmarks write their numbers: a markdown section appended to bench/RESULTS.md."""

from __future__ import annotations

import shlex
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
_HEADER = "# Benchmark results\n\nSections appended by the scripts in bench/; newest last.\n"


def append_section(text: str, path: Path | str = RESULTS) -> None:
    """Append ``text`` (a section starting with a ``##`` heading) after a blank line; ``path`` '-' skips it.

    The file is read again just before appending: another benchmark may have appended since this one started.
    """
    if str(path) == "-":
        return
    path = Path(path)
    if not path.exists():
        path.write_text(_HEADER)
    existing = path.read_text()
    separator = "" if existing.endswith("\n\n") else ("\n" if existing.endswith("\n") else "\n\n")
    with path.open("a") as f:
        f.write(separator + text.rstrip("\n") + "\n")
    print(f"appended to {path}", file=sys.stderr)


def command_line() -> str:
    """How this benchmark was started, as a command to paste: ``python bench/<script>.py <args>``."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(RESULTS.parent.parent)
    except ValueError:
        pass
    return " ".join(["python", shlex.quote(str(script)), *map(shlex.quote, sys.argv[1:])])


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A markdown table; cells are formatted by the caller (str() is applied)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, r)) + " |" for r in rows]
    return "\n".join(lines)


if __name__ == "__main__":  # python bench/results.py SECTION.md ...: append sections written elsewhere (a GPU call)
    for name in sys.argv[1:]:
        append_section(Path(name).read_text())
