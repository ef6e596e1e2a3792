"""Tables on the terminal, through rich: the one way the CLI prints rows."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from rich import box
from rich.console import Console
from rich.table import Table


def rows_table(rows: Sequence[dict], columns: Sequence[str] | None = None, caption: str | None = None) -> Table:
    """``rows`` (dicts with the same keys) as a rich table; ``columns`` picks and orders them (default: the first
    row's keys). None shows as ``-``."""
    columns = list(columns or (rows[0] if rows else ()))
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, caption=caption)
    for name in columns:
        table.add_column(name, overflow="fold")
    for row in rows:
        table.add_row(*("-" if row[c] is None else str(row[c]) for c in columns))
    return table


def print_table(rows: Sequence[dict], columns: Sequence[str] | None = None, console: Console | None = None) -> None:
    """``rows`` as a table (``rows_table``) on the terminal; ``(none)`` when there are no rows."""
    # Piped output keeps whole rows (for grep and scripts) instead of folding at rich's default 80 columns.
    console = console or Console(width=None if sys.stdout.isatty() else 1000)
    if not rows:
        console.print("(none)")
        return
    console.print(rows_table(rows, columns))
