"""Schema migrations against a real PostgreSQL (the session's ``database_url``)."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime

import asyncpg
import pytest

from switchyard.migrations import Migration, apply_migrations, load_migrations
from tests.support.databases import own_database


@pytest.fixture
async def fresh_database_url(database_url):
    """An empty database on the session's server, dropped afterwards."""
    async with own_database(database_url, "migrations") as url:
        yield url


async def _applied(url: str) -> list[str]:
    conn = await asyncpg.connect(url)
    try:
        return [r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations ORDER BY name")]
    finally:
        await conn.close()


def test_shipped_migrations_are_ordered_and_named():
    migrations = load_migrations()
    names = [m.name for m in migrations]
    assert names[0] == "0001_requests"
    assert names == sorted(set(names))
    assert all(m.name[:4].isdigit() and m.sql.strip() for m in migrations)


async def test_fresh_database_gets_every_migration(fresh_database_url):
    expected = [m.name for m in load_migrations()]
    assert await apply_migrations(fresh_database_url) == expected
    assert await _applied(fresh_database_url) == expected


async def test_second_apply_is_a_no_op(database_url):
    # The fixture has applied everything already.
    assert await apply_migrations(database_url) == []
    conn = await asyncpg.connect(database_url)
    try:
        assert await conn.fetchval("SELECT to_regclass('requests') IS NOT NULL")
        assert await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL")
    finally:
        await conn.close()


async def test_requests_table_shape(database_url):
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT column_name, data_type, is_nullable FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = 'requests'"
        )
        columns = {r["column_name"]: (r["data_type"], r["is_nullable"] == "YES") for r in rows}
        assert columns == {
            "request_id": ("text", False),
            "model": ("text", False),
            "tier": ("text", False),
            "tenant_id": ("text", True),
            "api_key_id": ("text", True),
            "prompt_tokens": ("integer", False),
            "completion_tokens": ("integer", False),
            "cached_tokens": ("integer", False),
            "finish_reason": ("text", False),
            "queue_ms": ("double precision", False),
            "first_token_ms": ("double precision", True),
            "total_ms": ("double precision", False),
            "worker_id": ("text", True),
            "created_at": ("timestamp with time zone", False),
            "recorded_at": ("timestamp with time zone", False),
            "cost_usd": ("numeric", False),
            "end_user": ("text", True),
            "metadata": ("jsonb", True),
            "prefill_worker_id": ("text", True),
            "kv_loaded_bytes": ("bigint", False),
        }
    finally:
        await conn.close()


async def test_requests_defaults_and_key(database_url):
    insert = ("INSERT INTO requests (request_id, model, tier, prompt_tokens, completion_tokens,"
              " finish_reason, queue_ms, total_ms, created_at)"
              " VALUES ($1, 'smollm2', 'standard', 12, 5, 'stop', 1.5, 80.0, $2)")
    conn = await asyncpg.connect(database_url)
    tx = conn.transaction()
    await tx.start()
    try:  # rolled back at the end: the database is shared by the session
        await conn.execute(insert, "req-1", datetime.now(UTC))
        row = await conn.fetchrow("SELECT cached_tokens, recorded_at FROM requests WHERE request_id = 'req-1'")
        assert row["cached_tokens"] == 0
        assert row["recorded_at"] is not None
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.execute(insert, "req-1", datetime.now(UTC))
    finally:
        await tx.rollback()
        await conn.close()


async def test_concurrent_appliers_apply_each_migration_once(fresh_database_url):
    results = await asyncio.gather(*(apply_migrations(fresh_database_url) for _ in range(4)))
    expected = [m.name for m in load_migrations()]
    assert sorted(results, key=len) == [[], [], [], expected]
    assert await _applied(fresh_database_url) == expected


async def test_failed_migration_leaves_nothing_and_is_retried(fresh_database_url):
    good = Migration("0001_a", "CREATE TABLE a (x int)")
    bad = Migration("0002_b", "CREATE TABLE b (x int); SELECT 1 / 0;")
    with pytest.raises(asyncpg.DivisionByZeroError):
        await apply_migrations(fresh_database_url, [good, bad])
    assert await _applied(fresh_database_url) == ["0001_a"]
    conn = await asyncpg.connect(fresh_database_url)
    try:
        assert await conn.fetchval("SELECT to_regclass('b')") is None  # rolled back with its file
    finally:
        await conn.close()

    fixed = Migration("0002_b", "CREATE TABLE b (x int)")
    assert await apply_migrations(fresh_database_url, [good, fixed]) == ["0002_b"]
    assert await _applied(fresh_database_url) == ["0001_a", "0002_b"]
