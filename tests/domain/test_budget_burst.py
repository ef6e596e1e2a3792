"""The monthly budget in a real PostgreSQL under a burst: a tenant's reservations sent at once from two gateways
(each gathering what arrives together into one statement, migration 0021) never pass the budget, none is refused
that would still fit, and what ended requests reserved comes back."""

from __future__ import annotations

import asyncio
import secrets

import asyncpg
import pytest

from switchyard.domain.admission.budget import MonthlyBudget
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.auth import AuthContext
from switchyard.domain.database import Database
from switchyard.domain.errors import OpenAIError


@pytest.fixture
async def gateways(database_url):
    pools = [await asyncpg.create_pool(database_url, min_size=1, max_size=4) for _ in range(2)]
    yield [MonthlyBudget(Database(pool)) for pool in pools]
    for pool in pools:
        await pool.close()


async def test_a_burst_reserves_exactly_within_the_budget_and_gives_it_back(gateways, database_url):
    tenant, budget = f"t-{secrets.token_hex(4)}", 300
    auth = AuthContext(tenant, tenant, "k", "pro", None, None, budget)
    tickets = [(gateways[i % 2], Ticket(Origin.REQUEST, auth, f"req-{i}", "m", estimated_tokens=5 + i % 7))
               for i in range(200)]

    async def reserved(policy: MonthlyBudget, ticket: Ticket) -> bool:
        try:
            await policy.check(ticket)
            return True
        except OpenAIError as exc:
            assert exc.code == "insufficient_quota"
            return False

    results = await asyncio.gather(*(reserved(g, t) for g, t in tickets))
    held = sum(t.estimated_tokens for (_, t), ok in zip(tickets, results) if ok)
    assert held <= budget
    for (_, t), ok in zip(tickets, results):
        assert ok or held + t.estimated_tokens > budget
    conn = await asyncpg.connect(database_url)
    try:
        row_reserved = "SELECT reserved FROM budget_months WHERE tenant_id = $1"
        assert await conn.fetchval(row_reserved, tenant) == held
        await asyncio.gather(*(g.settle(t, 1) for (g, t), ok in zip(tickets, results) if ok))
        assert await conn.fetchval(row_reserved, tenant) == 0
    finally:
        await conn.close()
