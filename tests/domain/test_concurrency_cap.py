"""The per-tenant concurrency cap in a real PostgreSQL, as two gateways hold it: admissions sent from both at once
stop at the cap (the tenant's advisory lock and the count under it, one statement: migration 0017), another
tenant's are counted apart, and a settled request frees its seat."""

from __future__ import annotations

import asyncio
import secrets

import asyncpg
import pytest

from switchyard.domain.admission.concurrency import Concurrency
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.auth import AuthContext
from switchyard.domain.database import Database
from switchyard.domain.errors import OpenAIError
from switchyard.shared.tiers import TierPolicy


class NoTierCaps:
    """The tier policies as the gateway's cache gives them: the pro tier without caps of its own (the key's apply)."""

    async def get(self) -> dict[str, TierPolicy]:
        return {"pro": TierPolicy(max_queued=100, max_wait_s=10.0, weight=1.0)}


@pytest.fixture
async def gateways(database_url):
    pools = [await asyncpg.create_pool(database_url, min_size=1, max_size=8) for _ in range(2)]
    yield [Concurrency(Database(pool), NoTierCaps()) for pool in pools]
    for pool in pools:
        await pool.close()


def ticket(tenant: str, max_streams: int) -> Ticket:
    auth = AuthContext(tenant, tenant, "k", "pro", None, None, None, max_streams=max_streams)
    return Ticket(Origin.REQUEST, auth, f"req-{secrets.token_hex(8)}", "m")


async def admitted(policy: Concurrency, t: Ticket) -> bool:
    try:
        await policy.check(t)
        return True
    except OpenAIError as exc:
        assert exc.code == "concurrency_limit_exceeded"
        return False


async def test_admissions_from_two_gateways_at_once_stop_at_the_cap(gateways):
    heavy, light = f"t-{secrets.token_hex(4)}", f"t-{secrets.token_hex(4)}"
    tickets = [(gateways[i % 2], ticket(heavy, 5)) for i in range(40)] + [(gateways[0], ticket(light, 5))]
    results = await asyncio.gather(*(admitted(g, t) for g, t in tickets))
    assert sum(results[:40]) == 5 and results[40]  # the other tenant is counted apart
    owner, first = next(pair for pair, ok in zip(tickets, results) if ok)  # one of the heavy tenant's five
    await owner.settle(first, 10)
    assert await admitted(gateways[1], ticket(heavy, 5))  # its seat freed
    assert not await admitted(gateways[0], ticket(heavy, 5))
