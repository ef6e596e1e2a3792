"""The gateway's Postgres calls under load and in an outage, on a real Postgres: waiting for a busy pool is load
and never opens the breaker; a call that does not answer is an outage and does."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.domain import database
from switchyard.domain.database import Database, DatabaseBusy, DatabaseUnavailable, connect


@pytest.fixture
async def small_pool(database_url):
    pool = await connect(database_url, max_size=2)
    try:
        yield pool
    finally:
        await pool.close()


def sleep_for(seconds: float):
    return lambda pool: pool.fetchval("SELECT pg_sleep($1)::text || 'slept'", seconds)


async def test_calls_queued_behind_a_busy_pool_wait_their_turn_past_the_call_bound_without_an_outage(small_pool):
    """Eight calls of 0.6 s on two connections: the last starts 1.8 s in and ends past CALL_TIMEOUT_S (2 s) from
    when it was made. Counted from its turn it took 0.6 s: every call answers and the breaker stays closed (it
    used to open, and every request whose key was not cached got 503 for five seconds)."""
    db = Database(small_pool)
    assert 8 * 0.6 / 2 > database.CALL_TIMEOUT_S
    results = await asyncio.gather(*(db.run(sleep_for(0.6)) for _ in range(8)))
    assert results == ["slept"] * 8
    assert not db.degraded


async def test_a_call_that_finds_no_free_connection_in_time_falls_back_without_opening_the_breaker(
        small_pool, monkeypatch):
    monkeypatch.setattr(database, "TURN_WAIT_S", 0.2)
    db = Database(small_pool)
    holders = [asyncio.create_task(db.run(sleep_for(1.0))) for _ in range(2)]
    await asyncio.sleep(0)  # both take their turns before the next call asks
    with pytest.raises(DatabaseBusy):
        await db.run(sleep_for(0))
    assert await asyncio.gather(*holders) == ["slept", "slept"]
    assert not db.degraded
    assert await db.run(sleep_for(0)) == "slept"


async def test_a_call_that_does_not_answer_opens_the_breaker_and_the_calls_waiting_behind_it_fall_back_at_once(
        small_pool, monkeypatch):
    monkeypatch.setattr(database, "CALL_TIMEOUT_S", 0.3)
    db = Database(small_pool)
    hung = [asyncio.create_task(db.run(sleep_for(5.0))) for _ in range(2)]
    waiting = asyncio.create_task(db.run(sleep_for(0)))  # its turn comes when the hung ones time out
    for task in hung:
        with pytest.raises(DatabaseUnavailable):
            await task
    assert db.degraded
    with pytest.raises(DatabaseUnavailable):
        await asyncio.wait_for(waiting, 0.5)  # not a query of its own on a server found down
    with pytest.raises(DatabaseUnavailable):  # and later callers go straight to their fallbacks
        await db.run(sleep_for(0))


async def test_one_tenants_calls_hold_one_connection_at_a_time_and_never_queue_another_tenant_behind_them(
        small_pool):
    """A tenant with many requests at once: its calls about its own rows (a row lock in Postgres would serialise
    them anyway) wait for each other without a connection, so another tenant's call gets the other connection at
    once instead of waiting behind all of them."""
    db = Database(small_pool)
    heavy = [asyncio.create_task(db.run(sleep_for(0.5), key="heavy")) for _ in range(6)]
    await asyncio.sleep(0)
    started = asyncio.get_running_loop().time()
    assert await db.run(sleep_for(0), key="light") == "slept"
    assert asyncio.get_running_loop().time() - started < 0.4  # not behind the heavy calls (1.5 s unkeyed)
    assert await asyncio.gather(*heavy) == ["slept"] * 6
    assert db._keys == {}  # nothing kept for keys with no call


async def test_a_connection_left_inside_a_transaction_or_after_a_failed_one_goes_back_clean(database_url):
    pool = await connect(database_url, max_size=1)  # one connection: the next user gets the very same one
    try:
        async with pool.acquire() as conn:
            await conn.execute("CREATE TEMP TABLE t_kept (x int)")  # session state outside any transaction stays
            await conn.execute("BEGIN")  # left open by a caller that was cancelled, say
            await conn.execute("INSERT INTO t_kept VALUES (1)")
        with pytest.raises(ZeroDivisionError):
            async with pool.acquire() as conn, conn.transaction():
                await conn.execute("INSERT INTO t_kept VALUES (2)")
                raise ZeroDivisionError("inside the transaction")
        async with pool.acquire() as conn:
            assert not conn.is_in_transaction()
            assert await conn.fetchval("SELECT count(*) FROM t_kept") == 0  # both transactions were undone
    finally:
        await pool.close()
