"""Admission policy: the tenant's monthly token budget, for every request, batch and batch line alike.

Spent is judged by the month's billed tokens (the ``requests`` table), read at most every ``CACHE_S`` per tenant.
While Postgres is away the last total read stands (or none, if none was: usage is still billed, and the budget
holds again once Postgres is back).
"""

from __future__ import annotations

import time

from switchyard.domain.admission.pipeline import ALL_ORIGINS, Policy
from switchyard.domain.admission.ticket import Ticket
from switchyard.domain.database import Database, DatabaseUnavailable
from switchyard.domain.errors import OpenAIError

CACHE_S = 5.0
MONTH_USAGE_SQL = ("SELECT coalesce(sum(prompt_tokens + completion_tokens), 0) FROM requests "
                   "WHERE tenant_id = $1 AND created_at >= date_trunc('month', now())")


class MonthlyBudget(Policy):
    origins = ALL_ORIGINS

    def __init__(self, db: Database) -> None:
        self._db = db
        self._used: dict[str, tuple[int, float]] = {}  # tenant id -> (tokens this month, read at)

    async def check(self, ticket: Ticket) -> None:
        budget = ticket.auth.monthly_token_budget
        if budget is None:
            return
        tenant_id = ticket.auth.tenant_id
        cached = self._used.get(tenant_id)
        now = time.monotonic()
        if cached is None or now - cached[1] > CACHE_S:
            try:
                used = await self._db.run(lambda pool: pool.fetchval(MONTH_USAGE_SQL, tenant_id))
            except DatabaseUnavailable:
                if cached is None:
                    return  # never read: judged again once Postgres is back (the usage is billed meanwhile)
            else:
                cached = (int(used), now)
                self._used[tenant_id] = cached
        if cached[0] >= budget:
            raise OpenAIError(429, f"You exceeded your monthly token budget ({budget} tokens). Ask your "
                              "administrator to raise it.", type="insufficient_quota", code="insufficient_quota")
