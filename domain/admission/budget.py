"""Admission policy: the tenant's monthly token budget, for every request, batch and batch line alike.

A month's row (``budget_months``) holds the tokens billed (the usage writer adds each row it inserts, in the same
statement: jobs/usage_writer.py) and the tokens reserved by requests admitted and not yet ended. An API request
reserves what it may use (its estimate, as the rate window reserves it) under the row's lock, refused when
billed + reserved + its estimate would pass the budget, so a burst of concurrent requests cannot overrun it; a
tenant's requests that reach a gateway together are judged in one statement, each in turn as if alone
(domain/grouped_calls.py, migration 0021). The reservation goes when the request ends (its tokens then arrive as
billed, within the writer's lag). A batch, and
each of its lines (paced by the batch runner, at most a few hundred queued), is judged by what is billed and
reserved, without a reservation of its own.

While Postgres is away the last reading of each tenant stands (or none, if none was: usage is still billed, and
the budget holds again once Postgres is back). A reading is kept for ``READING_KEPT_S`` after it was taken, as long
as the authenticator serves a key from its cache through an outage (auth.STALE_OK_S): a tenant that stopped calling
is not held in memory for good.
"""

from __future__ import annotations

import datetime as dt
import time

import asyncpg

from switchyard.domain.admission.pipeline import Policy
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.auth import STALE_OK_S
from switchyard.domain.database import Database, DatabaseUnavailable
from switchyard.domain.errors import OpenAIError
from switchyard.domain.grouped_calls import GroupedCalls

RESERVE_SQL = "SELECT reserved, spent FROM reserve_budget($1, $2::date, $3::bigint[], $4::bigint[])"
SPENT_SQL = "SELECT billed + reserved FROM budget_months WHERE tenant_id = $1 AND month = $2"
RELEASE_SQL = "SELECT release_budget($1, $2::date[], $3::bigint[])"

Month = tuple[str, dt.date]  # (tenant id, the month's first day)

READING_KEPT_S = STALE_OK_S
FORGET_EVERY_S = 60.0  # readings past READING_KEPT_S are looked for at most this often


async def _reserve(pool: asyncpg.Pool, month: Month, asked: list[tuple[int, int]]) -> list[int | None]:
    """One statement for ``asked`` ((tokens, budget) of one tenant's requests, in arrival order): each one's billed
    + reserved after it, or None when it did not fit."""
    tenant_id, first_day = month
    rows = await pool.fetch(RESERVE_SQL, tenant_id, first_day, [t for t, _ in asked], [b for _, b in asked])
    return [row["spent"] if row["reserved"] else None for row in rows]


async def _release(pool: asyncpg.Pool, tenant_id: str, reserved: list[tuple[dt.date, int]]) -> list[None]:
    await pool.execute(RELEASE_SQL, tenant_id, [m for m, _ in reserved], [t for _, t in reserved])
    return [None] * len(reserved)


def _month_start() -> dt.date:
    now = dt.datetime.now(dt.UTC)
    return dt.date(now.year, now.month, 1)


def _refusal(budget: int) -> OpenAIError:
    return OpenAIError(429, f"You exceeded your monthly token budget ({budget} tokens), counting what your requests "
                       "in progress may still use. Ask your administrator to raise it.", type="insufficient_quota",
                       code="insufficient_quota")


class MonthlyBudget(Policy):
    origins = frozenset({Origin.REQUEST, Origin.BATCH, Origin.BATCH_LINE})

    def __init__(self, db: Database) -> None:
        self._db = db
        self._reserves = GroupedCalls(db, _reserve, rows_of=lambda month: month[0])
        self._releases = GroupedCalls(db, _release)
        # tenant id -> billed + reserved at the last reading (the outage fallback), and when it was read (monotonic)
        self._spent: dict[str, tuple[int, float]] = {}
        self._forgotten_at = time.monotonic()

    async def check(self, ticket: Ticket) -> None:
        # Here as well as in upkeep: the jobs' batches and lines pass this policy, and nothing calls their upkeep.
        now = time.monotonic()
        if now - self._forgotten_at > FORGET_EVERY_S:
            self.forget_idle(now)
        budget = ticket.auth.monthly_token_budget
        if budget is None:
            return
        tenant_id, month = ticket.auth.tenant_id, _month_start()
        reserve = ticket.origin is Origin.REQUEST
        try:
            if reserve:
                spent = await self._reserves.call((tenant_id, month), (ticket.estimated_tokens, budget))
            else:
                spent = await self._db.run(lambda pool: pool.fetchval(SPENT_SQL, tenant_id, month),
                                           key=tenant_id) or 0
        except DatabaseUnavailable:
            if self._spent.get(tenant_id, (0, now))[0] >= budget:
                raise _refusal(budget) from None
            return  # never read, or under it when last read: judged again once Postgres is back
        if spent is None or (spent >= budget and not reserve):  # None: the reservation did not fit
            self._spent[tenant_id] = (budget, now)
            raise _refusal(budget)
        self._spent[tenant_id] = (spent, now)
        if reserve:
            ticket.budget_reserved, ticket.budget_month = ticket.estimated_tokens, month

    def forget_idle(self, now: float | None = None) -> None:
        """Drop the readings taken more than ``READING_KEPT_S`` ago (tenants that stopped calling)."""
        now = time.monotonic() if now is None else now
        self._forgotten_at = now
        self._spent = {t: reading for t, reading in self._spent.items() if now - reading[1] <= READING_KEPT_S}

    async def upkeep(self) -> None:
        self.forget_idle()

    def tenant_state(self) -> dict[str, int]:
        return {"budget_readings": len(self._spent)}

    async def settle(self, ticket: Ticket, used_tokens: int | None) -> None:
        reserved, ticket.budget_reserved = ticket.budget_reserved, 0
        if not reserved or ticket.budget_month is None:  # a reservation always has its month
            return
        try:
            await self._releases.call(ticket.auth.tenant_id, (ticket.budget_month, reserved))
        except DatabaseUnavailable:
            pass  # held until the month ends: a budget errs on the safe side, as the rate window does
