"""The shared rate limit in Postgres is a sliding minute: a key that spent its limit at the end of one minute
does not get it all again at the start of the next (the 2x burst of fixed windows)."""

from __future__ import annotations

import uuid
from unittest import mock

import asyncpg
import pytest

from switchyard.domain.auth import AuthContext
from switchyard.domain.database import Database
from switchyard.domain.errors import OpenAIError
from switchyard.domain.limits import Limiter
from switchyard.shared.tiers import TierPolicy
from tests.support.system import make_key

POLICY = TierPolicy(max_queued=10, max_wait_s=10, weight=1, rpm=10, tpm=0)


async def _admitted(limiter: Limiter, auth: AuthContext, at: float, count: int) -> int:
    admitted = 0
    with mock.patch("switchyard.domain.limits.time.time", return_value=at):
        for _ in range(count):
            try:
                await limiter.admit(auth, POLICY, 1)
                admitted += 1
            except OpenAIError as exc:
                assert exc.status == 429 and exc.code == "rate_limit_exceeded"
    return admitted


@pytest.fixture
async def limiter_and_key(database_url):
    tenant = f"window-{uuid.uuid4().hex[:8]}"
    await make_key(database_url, tenant, "pro")
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    try:
        row = await pool.fetchrow("SELECT k.id, t.id AS tenant_id FROM api_keys k JOIN tenants t "
                                  "ON t.id = k.tenant_id WHERE t.name = $1", tenant)
        yield Limiter(Database(pool)), AuthContext(row["tenant_id"], tenant, row["id"], "pro", None, None, None)
    finally:
        await pool.close()


async def test_a_limit_spent_at_the_end_of_a_minute_is_not_spent_again_at_the_start_of_the_next(limiter_and_key):
    limiter, auth = limiter_and_key
    minute = 60 * 29_000_000  # some minute boundary, far from now
    assert await _admitted(limiter, auth, minute - 1, 12) == 10  # 10 per minute
    # One second into the next minute the previous one still counts for 59/60 of its 10 (rounded up: the limit
    # is never exceeded): nothing more yet.
    assert await _admitted(limiter, auth, minute + 1, 5) == 0
    # Half-way through, half of it: five more.
    assert await _admitted(limiter, auth, minute + 30, 8) == 5
    # Half-way through the minute after, the burst has slid out and those five count for half (3, rounded up).
    assert await _admitted(limiter, auth, minute + 90, 10) == 7


async def test_a_burst_on_one_key_is_admitted_exactly_to_its_limits(limiter_and_key):
    """Hundreds at once on one key (gathered into a few statements, migration 0020), of mixed sizes: no more than
    the limits allow, none refused that would still fit, and each answer's headers count what it left; the
    settles, gathered too, give back every unused token."""
    import asyncio

    limiter, auth = limiter_and_key
    policy = TierPolicy(max_queued=10, max_wait_s=10, weight=1, rpm=50, tpm=120)
    minute = 60 * 29_000_100

    async def one(tokens: int):
        try:
            return await limiter.admit(auth, policy, tokens)
        except OpenAIError as exc:
            assert exc.status == 429 and exc.code == "rate_limit_exceeded"
            return None

    sizes = [1 + i % 4 for i in range(300)]
    with mock.patch("switchyard.domain.limits.time.time", return_value=minute + 1):
        results = await asyncio.gather(*(one(t) for t in sizes))
    admitted = [(t, r) for t, r in zip(sizes, results) if r is not None]
    requests, tokens = len(admitted), sum(t for t, _ in admitted)
    assert requests <= 50 and tokens <= 120
    for t, r in zip(sizes, results):
        assert r is not None or requests == 50 or tokens + t > 120
    remaining = sorted(int(r.headers["x-ratelimit-remaining-tokens"]) for _, r in admitted)
    assert remaining[0] == 120 - tokens and remaining[-1] == 120 - admitted[0][0]
    await asyncio.gather(*(limiter.settle(r, 0) for _, r in admitted))
    row = await limiter._db.pool.fetchrow("SELECT requests, tokens FROM rate_windows WHERE key_id = $1 AND "
                                          "window_start = $2", auth.key_id, admitted[0][1].window_start)
    assert tuple(row) == (requests, 0)  # every token given back; the requests stay counted
