"""Postgres as the gateway and the jobs reach it, and what they do while it is down or hung.

Every call on the request path (authentication, rate limits, quotas) goes through ``Database.run``, which bounds
it by ``CALL_TIMEOUT_S`` and, after a failure, stops trying for ``RETRY_AFTER_S`` (one call then probes): during an
outage a request pays at most one timeout, not one per query, and each caller falls back at once. The fallbacks
live with their callers: known keys are served from the authentication cache, rate limits from a local share
(domain/local_limits.py), conversation turns are held in JetStream (jobs/held_writes.py); billing never touches
Postgres on the request path (usage records go through JetStream). Anything else that meets the outage (listing
files, usage reports) answers 503 with Retry-After, never a 500 or a hang (gateway/errors.py).

A call waits for its turn first (at most the pool's connections run at once): that wait is load, not an outage,
so it is not part of the call's bound and never trips the breaker. A thousand tenants arriving at once queue for
the pool; counted in the bound, their waits would open the breaker, and every request whose key is not cached yet
would get 503 for ``RETRY_AFTER_S``. A wait past ``TURN_WAIT_S`` gives up with ``DatabaseBusy`` (the callers' fallbacks
apply, the breaker stays closed). Calls about one tenant's rows (its rate window, budget, open requests) carry its
``key`` and run one at a time here: a tenant with hundreds of requests at once then waits for its own calls without
holding a connection, instead of queueing on its row locks inside Postgres with every connection held by it, and
another tenant's requests waiting behind them.

``connect`` makes the gateway's pool, its connects and statements bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from switchyard.domain.errors import OpenAIError, service_unavailable

log = logging.getLogger("switchyard.database")

T = TypeVar("T")

# A connection of its own (the jobs') or one a pool lends for a transaction: both run the same statements.
Connection = asyncpg.Connection | PoolConnectionProxy

CALL_TIMEOUT_S = 2.0  # a request path query takes milliseconds; two seconds without an answer is an outage
RETRY_AFTER_S = 5  # after a failure, how long callers go straight to their fallbacks before one probes again
TURN_WAIT_S = 10.0  # the longest a call waits for a free connection before its caller falls back (load shedding)
STATEMENT_TIMEOUT_S = 10.0  # any statement of the gateway's (a connect is bounded by CALL_TIMEOUT_S)

# A database that is down, hung, restarting or out of connections: not a bug, an outage.
# OperatorInterventionError covers a server shutting down (AdminShutdown, CrashShutdown), not accepting
# connections yet (CannotConnectNow) and a cancelled statement (QueryCanceled).
OUTAGE_ERRORS = (OSError, asyncio.TimeoutError, asyncpg.PostgresConnectionError, asyncpg.InterfaceError,
                 asyncpg.exceptions.OperatorInterventionError, asyncpg.exceptions.TooManyConnectionsError)


class DatabaseUnavailable(Exception):
    """Postgres did not answer (or is known not to right now): the caller falls back or answers 503."""


class DatabaseBusy(DatabaseUnavailable):
    """Every connection stayed busy for ``TURN_WAIT_S``: load, not an outage (the breaker stays closed)."""


def database_unavailable() -> OpenAIError:
    """The 503 for a request that needs Postgres while it is away."""
    return service_unavailable("The database is unavailable right now; please retry.", RETRY_AFTER_S,
                               code="database_unavailable")


async def connect(database_url: str, max_size: int) -> asyncpg.Pool:
    """A pool of at most ``max_size`` connections (GatewayConfig.database_pool_size) whose connects and statements
    are bounded (``CALL_TIMEOUT_S``, ``STATEMENT_TIMEOUT_S``).

    A connection goes back to the pool as it is, not reset: nothing here leaves session state behind (no LISTEN,
    no SET, no session advisory lock, no cursor outside a transaction), and asyncpg's default reset is a round trip
    of its own on every release, four or more per request, each holding the connection from the next caller a
    little longer. An open transaction is still rolled back (asyncpg does that whatever the reset)."""
    return await asyncpg.create_pool(database_url, min_size=1, max_size=max_size, reset=keep_session,
                                     timeout=CALL_TIMEOUT_S, command_timeout=STATEMENT_TIMEOUT_S)


def inserted_row(row: asyncpg.Record | None) -> asyncpg.Record:
    """The row an ``INSERT ... RETURNING`` answered: it always answers the row it inserted."""
    assert row is not None
    return row


async def keep_session(conn: asyncpg.Connection) -> None:
    """A pool's ``reset`` for connections that leave no session state behind: nothing to undo (see ``connect``)."""


class _KeyLock:
    __slots__ = ("lock", "users")

    def __init__(self) -> None:
        self.lock, self.users = asyncio.Lock(), 0


class Database:
    """A pool with bounded calls and a circuit breaker; ``degraded`` says whether Postgres failed recently."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self.pool = pool
        self._failed_at: float | None = None
        self._probing = False
        self._turns = asyncio.Semaphore(pool.get_max_size())  # calls in flight: one per connection
        self._keys: dict[str, _KeyLock] = {}  # keys with calls running or waiting (dropped when none)

    def tenant_state(self) -> dict[str, int]:
        """Keys (a tenant's or an API key's rows) with calls running or waiting (shared/tenant_state.py)."""
        return {"db_key_locks": len(self._keys)}

    @property
    def degraded(self) -> bool:
        return self._failed_at is not None

    async def run(self, call: Callable[[asyncpg.Pool], Awaitable[T]], key: str | None = None) -> T:
        """``await call(pool)`` within ``CALL_TIMEOUT_S`` once a connection is free; raises DatabaseUnavailable on
        an outage, and at once while the breaker is open (one caller at a time probes once ``RETRY_AFTER_S`` has
        passed); DatabaseBusy when no connection was free for ``TURN_WAIT_S``. Calls with the same ``key`` (one
        tenant's rows) run one at a time, waiting for each other without a connection."""
        probe = False
        if self._failed_at is not None:
            if self._probing or time.monotonic() - self._failed_at < RETRY_AFTER_S:
                raise DatabaseUnavailable
            self._probing = probe = True
        try:
            async with self._one_per_key(key):
                await _within_turn_wait(self._turns.acquire())
                try:
                    if self._failed_at is not None and not probe:
                        raise DatabaseUnavailable  # found down while this call waited for its turn
                    result = await bounded(call(self.pool), CALL_TIMEOUT_S)
                finally:
                    self._turns.release()
        except OUTAGE_ERRORS as exc:
            if self._failed_at is None:
                log.warning("Postgres unavailable (%r): serving known keys from cache, limits locally", exc)
            self._failed_at = time.monotonic()
            raise DatabaseUnavailable from exc
        finally:
            if probe:
                self._probing = False
        if self._failed_at is not None:
            log.warning("Postgres is back")
            self._failed_at = None
        return result

    @contextlib.asynccontextmanager
    async def _one_per_key(self, key: str | None) -> AsyncIterator[None]:
        if key is None:
            yield
            return
        entry = self._keys.get(key)
        if entry is None:
            entry = self._keys[key] = _KeyLock()
        entry.users += 1
        try:
            await _within_turn_wait(entry.lock.acquire())
            try:
                yield
            finally:
                entry.lock.release()
        finally:
            entry.users -= 1
            if not entry.users:
                del self._keys[key]


async def _within_turn_wait(acquire: Awaitable[bool]) -> None:
    try:
        await asyncio.wait_for(acquire, TURN_WAIT_S)
    except TimeoutError:
        raise DatabaseBusy from None


async def bounded(coro: Awaitable[T], timeout: float) -> T:
    """``await coro``, or TimeoutError after ``timeout`` seconds without waiting for it to wind down: cancelling a
    query on a hung server waits on that server (asyncpg sends it a cancel request), which is the hang itself."""
    task = asyncio.ensure_future(coro)
    done, _ = await asyncio.wait({task}, timeout=timeout)
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: no "never retrieved" noise
        raise TimeoutError
    return task.result()


async def ping(db: Database) -> bool:
    """Whether Postgres answers now (through the breaker): /readyz reports it."""
    try:
        await db.run(lambda pool: pool.fetchval("SELECT 1"))
        return True
    except DatabaseUnavailable:
        return False
