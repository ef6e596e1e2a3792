"""Schema migrations: numbered SQL files in this package, applied in name order.

``0001_requests.sql`` sorts before ``0002_...``; a file, once applied, is never edited
(add a new one instead). Applied names are recorded in ``schema_migrations``.
"""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from typing import NamedTuple

import asyncpg

__all__ = ["Migration", "load_migrations", "apply_migrations"]

# Any fixed 64-bit key: serialises concurrent appliers (several workers booting at once).
_LOCK_KEY = 0x5359_4D49_4752_4154  # "SYMIGRAT"


class Migration(NamedTuple):
    name: str  # file name without ".sql", e.g. "0001_requests"
    sql: str


def load_migrations() -> list[Migration]:
    """All SQL files shipped in this package, in apply order."""
    files = [f for f in resources.files(__package__).iterdir() if f.name.endswith(".sql")]
    return [Migration(f.name.removesuffix(".sql"), f.read_text(encoding="utf-8"))
            for f in sorted(files, key=lambda f: f.name)]


async def apply_migrations(database_url: str, migrations: Sequence[Migration] | None = None) -> list[str]:
    """Apply the migrations not yet recorded in ``database_url``; return their names.

    Each file runs in its own transaction together with its ``schema_migrations`` row,
    so a failing file leaves nothing behind and is retried next time. Safe to call
    from several processes at once: they queue on an advisory lock, and all but the
    first find nothing left to do. ``migrations`` defaults to ``load_migrations()``.
    """
    if migrations is None:
        migrations = load_migrations()
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", _LOCK_KEY)
        try:
            await conn.execute(
                "CREATE TABLE IF NOT EXISTS schema_migrations ("
                " name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())"
            )
            done = {r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations")}
            applied = []
            for migration in sorted(migrations, key=lambda m: m.name):
                if migration.name in done:
                    continue
                async with conn.transaction():
                    await conn.execute(migration.sql)
                    await conn.execute("INSERT INTO schema_migrations (name) VALUES ($1)", migration.name)
                applied.append(migration.name)
            return applied
        finally:
            if not conn.is_closed():  # a dropped connection has released the lock already
                await conn.execute("SELECT pg_advisory_unlock($1)", _LOCK_KEY)
    finally:
        await conn.close()
