"""What a gateway (and the jobs, for the budget) holds in memory per tenant or API key is forgotten once the tenant
stops calling: the authenticator's answers and last uses, the budget's readings, the seats and rate windows held
while Postgres was away. Without servers: Postgres is a double that answers, or is away; time is a clock the test
moves (patched into the module alone, never the event loop's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from switchyard.domain import auth, local_limits
from switchyard.domain.admission import budget
from switchyard.domain.admission.budget import MonthlyBudget
from switchyard.domain.admission.concurrency import Concurrency
from switchyard.domain.admission.rate_limits import RateLimits
from switchyard.domain.admission.ticket import Origin, ServiceTier, Ticket
from switchyard.domain.auth import AuthContext, Authenticator
from switchyard.domain.database import DatabaseUnavailable
from switchyard.domain.errors import OpenAIError
from switchyard.domain.limits import Limiter
from switchyard.domain.tenancy import hash_key
from switchyard.shared.tiers import TierPolicy


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


class Pool:
    """Postgres as the policies read it: every key is valid (its tenant and id named after it), a tenant has spent
    ``spent`` of its month."""

    def __init__(self, keys: list[str], spent: int = 0) -> None:
        self._keys = {hash_key(k): k for k in keys}
        self.spent = spent

    async def fetchrow(self, sql: str, digest: bytes) -> dict:
        key = self._keys[digest]
        return {"key_id": key, "tenant_id": f"t-{key}", "name": key, "tier": "pro", "rpm_limit": None,
                "tpm_limit": None, "monthly_token_budget": None, "priority_allowed": False, "safety_policy": None,
                "max_streams": None, "max_sequences": None}

    async def fetchval(self, sql: str, *args) -> int:
        return self.spent

    async def execute(self, sql: str, *args) -> str:
        return "UPDATE 1"


class Db:
    """``Database`` as the policies call it; ``away``: every call raises DatabaseUnavailable."""

    def __init__(self, pool: Pool | None = None, away: bool = False) -> None:
        self.pool, self.away = pool, away

    async def run(self, call, key=None):
        if self.away:
            raise DatabaseUnavailable
        return await call(self.pool)


class Tiers:
    async def get(self) -> dict[str, TierPolicy]:
        return {"pro": TierPolicy(max_queued=100, max_wait_s=10.0, weight=1.0, rpm=100, tpm=100_000)}


def ticket(tenant: str, origin: Origin = Origin.REQUEST, budget_tokens: int | None = None) -> Ticket:
    context = AuthContext(tenant, tenant, f"key-{tenant}", "pro", None, None, budget_tokens, max_streams=5)
    t = Ticket(origin, context, f"req-{tenant}", "m", estimated_tokens=10)
    t.service = ServiceTier("pro")
    return t


async def test_the_authenticator_forgets_keys_that_stopped_calling(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(auth, "time", SimpleNamespace(monotonic=clock))
    authenticator = Authenticator(Db(Pool(["a", "b"])))
    for key in ("a", "b"):
        assert (await authenticator.authenticate(f"Bearer {key}")).key_id == key
    authenticator.forget_idle()
    assert len(authenticator._cache) == 2 and len(authenticator._last_used) == 2
    clock.now += auth._LAST_USED_EVERY_S + 1  # only "a" calls again
    await authenticator.authenticate("Bearer a")
    authenticator.forget_idle()
    assert set(authenticator._last_used) == {"a"}  # b's next use would write it again anyway
    assert len(authenticator._cache) == 2  # b's answer may still serve it through an outage
    clock.now += auth.STALE_OK_S
    await authenticator.authenticate("Bearer a")
    authenticator.forget_idle()
    assert list(authenticator._cache) == [hash_key("a")] and set(authenticator._last_used) == {"a"}


async def test_budget_readings_of_tenants_that_stopped_calling_are_forgotten(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(budget, "time", SimpleNamespace(monotonic=clock))
    db = Db(Pool([], spent=500))
    policy = MonthlyBudget(db)
    for tenant in ("gone", "staying"):
        await policy.check(ticket(tenant, Origin.BATCH, budget_tokens=1000))
    assert set(policy._spent) == {"gone", "staying"}
    clock.now += budget.READING_KEPT_S / 2
    await policy.check(ticket("staying", Origin.BATCH, budget_tokens=1000))
    clock.now += budget.READING_KEPT_S / 2 + 1
    await policy.check(ticket("staying", Origin.BATCH_LINE, budget_tokens=1000))  # a check sweeps (the jobs)
    assert set(policy._spent) == {"staying"}
    clock.now += budget.READING_KEPT_S + 1
    await policy.upkeep()  # and so does the gateway's upkeep, with no request at all
    assert policy._spent == {}


async def test_a_reading_kept_still_refuses_through_an_outage(monkeypatch):
    monkeypatch.setattr(budget, "time", SimpleNamespace(monotonic=Clock()))
    db = Db(Pool([], spent=1000))
    policy = MonthlyBudget(db)
    for _ in range(2):
        with pytest.raises(OpenAIError) as refused:
            await policy.check(ticket("spent", Origin.BATCH, budget_tokens=1000))
        assert refused.value.code == "insufficient_quota"
        db.away = True  # the second time, from the reading


async def test_seats_held_while_postgres_is_away_are_forgotten_once_given_back():
    policy = Concurrency(Db(away=True), Tiers(), local_share=1.0)
    tickets = [ticket(f"t{i}") for i in range(3)]
    for t in tickets:
        await policy.check(t)
    assert len(policy._local) == 3 and len(policy._local_ids) == 3
    for t in tickets:
        await policy.settle(t, 10)
    assert policy._local == {} and policy._local_ids == set() and policy._held == {}


async def test_rate_windows_kept_while_postgres_is_away_go_at_the_gateways_upkeep(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(local_limits, "time", SimpleNamespace(monotonic=clock))
    limiter = Limiter(Db(away=True))
    policy = RateLimits(limiter, Tiers())
    for tenant in ("gone", "staying"):
        t = ticket(tenant)
        await policy.check(t)
        await policy.settle(t, 5)
    assert set(limiter._local._windows) == {"key-gone", "key-staying"}
    clock.now += local_limits.WINDOW_S / 2
    await policy.check(ticket("staying"))
    clock.now += local_limits.WINDOW_S / 2 + 1
    await policy.upkeep()
    assert set(limiter._local._windows) == {"key-staying"}
