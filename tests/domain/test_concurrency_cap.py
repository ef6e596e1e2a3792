"""The per-tenant concurrency cap in a real PostgreSQL, as two gateways hold it: admissions sent from both at once
stop at the cap (the tenant's advisory lock and its count under it, one statement for what arrived together:
migration 0019), another tenant's are counted apart, a settled request frees its seat, expired leases hold none,
and gateways still on 0017 share the cap."""

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


def sized(tenant: str, n: int, max_streams: int, max_sequences: int) -> Ticket:
    auth = AuthContext(tenant, tenant, "k", "pro", None, None, None, max_streams=max_streams,
                       max_sequences=max_sequences)
    return Ticket(Origin.REQUEST, auth, f"req-{secrets.token_hex(8)}", "m", n=n)


async def counted(database_url: str, tenant: str) -> tuple[tuple[int, int], tuple[int, int]]:
    """The tenant's (streams, sequences) as ``open_request_counts`` keeps them, and as its live rows add up."""
    conn = await asyncpg.connect(database_url)
    try:
        kept = await conn.fetchrow("SELECT streams, sequences FROM open_request_counts WHERE tenant_id = $1", tenant)
        rows = await conn.fetchrow("SELECT count(*), coalesce(sum(sequences), 0) FROM open_requests "
                                   "WHERE tenant_id = $1", tenant)
    finally:
        await conn.close()
    return (tuple(kept) if kept else (0, 0)), tuple(rows)


async def test_a_burst_of_one_tenant_is_admitted_exactly_to_its_caps(gateways, database_url):
    """Hundreds at once from one tenant (gathered into a few statements by each gateway, migration 0019), of mixed
    sizes: the admitted never pass either cap, and none was refused that would still fit (each was judged against
    what the ones before it held, as one at a time)."""
    tenant = f"t-{secrets.token_hex(4)}"
    max_streams, max_sequences = 60, 100
    tickets = [(gateways[i % 2], sized(tenant, 1 + i % 3, max_streams, max_sequences)) for i in range(400)]
    results = await asyncio.gather(*(admitted(g, t) for g, t in tickets))
    streams = sum(results)
    sequences = sum(t.n for (_, t), ok in zip(tickets, results) if ok)
    assert streams <= max_streams and sequences <= max_sequences
    for (_, t), ok in zip(tickets, results):
        assert ok or streams == max_streams or sequences + t.n > max_sequences
    assert await counted(database_url, tenant) == ((streams, sequences), (streams, sequences))
    # Settled from either gateway, the count follows, and the seats are taken again at once.
    for (gateway, t), ok in list(zip(tickets, results))[:100]:
        if ok:
            await gateway.settle(t, 1)
    (kept, rows) = await counted(database_url, tenant)
    assert kept == rows and kept[0] < streams
    again = await asyncio.gather(*(admitted(gateways[i % 2], sized(tenant, 1, max_streams, max_sequences))
                                   for i in range(100)))
    assert sum(again) == min(max_streams - kept[0], max_sequences - kept[1])


async def test_expired_leases_do_not_count_and_leave_the_count(gateways, database_url):
    """A crashed gateway's leases (rows past expires_at) hold no seat: the next admission deletes them and the
    count follows; upkeep's expiry over many tenants keeps every tenant's count too."""
    tenant, other = f"t-{secrets.token_hex(4)}", f"t-{secrets.token_hex(4)}"
    conn = await asyncpg.connect(database_url)
    try:
        for who in (tenant, other):
            await conn.execute("INSERT INTO open_requests (request_id, tenant_id, sequences, expires_at) "
                               "SELECT $1 || '-dead-' || i, $1, 2, now() - interval '1 second' "
                               "FROM generate_series(1, 3) AS i", who)
        assert await counted(database_url, tenant) == ((3, 6), (3, 6))
        results = await asyncio.gather(*(admitted(gateways[0], sized(tenant, 1, 3, 100)) for _ in range(5)))
        assert sum(results) == 3  # all three seats: the dead leases were not counted
        assert await counted(database_url, tenant) == ((3, 3), (3, 3))
        await gateways[1].upkeep()  # deletes every expired row: the other tenant's
        assert await counted(database_url, other) == ((0, 0), (0, 0))
        with pytest.raises(asyncpg.RaiseError):  # a lease changes only its expiry
            await conn.execute("UPDATE open_requests SET sequences = 9 WHERE tenant_id = $1", tenant)
    finally:
        await conn.close()


async def test_gateways_on_0017_and_0019_at_once_hold_one_cap(gateways, database_url):
    """While gateways upgrade, some admit through 0017's function and some through 0019's: one advisory lock and
    one count (the triggers keep it for 0017's inserts too), so the cap still holds."""
    tenant = f"t-{secrets.token_hex(4)}"

    async def old_gateway(i: int) -> bool:
        conn = await asyncpg.connect(database_url)
        try:
            return await conn.fetchval(
                "SELECT admit_open_request($1, $2, 1, 10::bigint, 100::bigint, 300::float8, $3::bigint)",
                f"old-{tenant}-{i}", tenant, 0x5359_434F_4E43) is not None
        finally:
            await conn.close()

    results = await asyncio.gather(*(old_gateway(i) for i in range(10)),
                                   *(admitted(gateways[i % 2], sized(tenant, 1, 10, 100)) for i in range(30)))
    assert sum(results) == 10
    assert await counted(database_url, tenant) == ((10, 10), (10, 10))
