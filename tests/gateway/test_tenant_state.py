"""What a gateway holds per tenant, key or conversation, on its ``/metrics`` (shared/tenant_state.py): scraped from
its registry as Prometheus reads it, one ``switchyard:tenant_state_entries`` sample per structure with its entries
at that moment; the middleware watch theirs when they are made, and watching again replaces, never adds. Without
servers: Postgres is a double that is away, so admissions are held in the gateway's memory."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from switchyard.domain.admission.budget import MonthlyBudget
from switchyard.domain.admission.concurrency import Concurrency
from switchyard.domain.admission.pipeline import Pipeline
from switchyard.domain.admission.rate_limits import RateLimits
from switchyard.domain.admission.ticket import Origin, ServiceTier, Ticket
from switchyard.domain.auth import AuthContext, Authenticator
from switchyard.domain.database import DatabaseUnavailable
from switchyard.domain.limits import Limiter
from switchyard.gateway.gatekeeper import Gatekeeper
from switchyard.gateway.kv_index import KVIndex
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.refused_bodies import RefusedBodies
from switchyard.shared.metrics import render
from switchyard.shared.tiers import TierPolicy


class AwayDb:
    async def run(self, call, key=None):
        raise DatabaseUnavailable


class Tiers:
    async def get(self) -> dict[str, TierPolicy]:
        return {"pro": TierPolicy(max_queued=100, max_wait_s=10.0, weight=1.0, rpm=100, tpm=100_000)}


def ticket(tenant: str) -> Ticket:
    context = AuthContext(tenant, tenant, f"key-{tenant}", "pro", None, None, None, max_streams=5)
    t = Ticket(Origin.REQUEST, context, f"req-{tenant}", "m", estimated_tokens=10)
    t.service = ServiceTier("pro")
    return t


def scraped(metrics: GatewayMetrics) -> dict[str, float]:
    """structure -> entries, from the gateway's /metrics text."""
    families = {f.name: f for f in text_string_to_metric_families(render(metrics.registry).decode())}
    family = families["switchyard:tenant_state_entries"]
    assert family.type == "gauge"
    return {sample.labels["structure"]: sample.value for sample in family.samples}


async def test_the_gateways_structures_are_scraped_with_their_entries_now():
    metrics = GatewayMetrics()
    assert scraped(metrics) == {}  # nothing watched yet: the family, without samples
    db = AwayDb()
    pipeline = Pipeline([MonthlyBudget(db), RateLimits(Limiter(db), Tiers()), Concurrency(db, Tiers())])
    tickets = [ticket(tenant) for tenant in ("a", "b", "c")]
    for t in tickets:
        await pipeline.check(t)  # Postgres away: each tenant's window and seat held here
    metrics.tenant_state.watch("admission", pipeline.tenant_state)
    metrics.tenant_state.watch("authenticator", Authenticator(db).tenant_state)
    metrics.tenant_state.watch("placement", KVIndex().tenant_state)
    services = SimpleNamespace(metrics=metrics)
    Gatekeeper(None, services, per_minute=3, trusted_proxies=[])._failures.failed("203.0.113.9")
    RefusedBodies(None, per_minute=100, metrics=metrics)
    assert scraped(metrics) == {
        "budget_readings": 0, "local_rate_windows": 3, "concurrency_requests": 3, "concurrency_local_tenants": 3,
        "auth_keys": 0, "auth_last_used": 0, "kv_index_prefixes": 0, "kv_index_pool_blocks": 0,
        "kv_index_tier_blocks": 0, "failed_auth_addresses": 1, "refused_body_keys": 0}
    for t in tickets[:2]:
        await pipeline.settle(t, 5)
    Gatekeeper(None, services, per_minute=3, trusted_proxies=[])  # made again: its own, empty, replaces the first
    now = scraped(metrics)
    assert (now["concurrency_requests"], now["concurrency_local_tenants"], now["failed_auth_addresses"]) == (1, 1, 0)
