"""Helpers for tests and benchmarks that run real servers: free ports and API keys."""

from __future__ import annotations

import socket

import asyncpg

from switchyard.gateway.tenancy import create_key, create_tenant


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def make_key(database_url: str, tenant: str, tier: str = "pro", **limits) -> str:
    """A new key for ``tenant`` (created on ``tier`` with ``limits`` unless it exists); returns the secret."""
    conn = await asyncpg.connect(database_url)
    try:
        if not await conn.fetchval("SELECT 1 FROM tenants WHERE name = $1", tenant):
            await create_tenant(conn, tenant, tier, **limits)
        return (await create_key(conn, tenant)).secret
    finally:
        await conn.close()
