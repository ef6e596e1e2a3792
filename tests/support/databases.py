"""Databases of their own on the session's PostgreSQL server, for tests that must not see each other's rows."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from urllib.parse import urlsplit, urlunsplit

import asyncpg


def with_database(url: str, name: str) -> str:
    """``url`` pointing at the database ``name`` on the same server."""
    return urlunsplit(urlsplit(url)._replace(path=f"/{name}"))


@asynccontextmanager
async def own_database(server_url: str, prefix: str) -> AsyncIterator[str]:
    """The URL of a new empty database on ``server_url``'s server, dropped (with any connection still open to it)
    on exit."""
    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(server_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        try:
            yield with_database(server_url, name)
        finally:
            await admin.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    finally:
        await admin.close()
