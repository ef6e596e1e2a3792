"""When a request is hedged and where (gateway/hedging.py): the tier's delay or its recent TTFT p95, a budget
that holds, never for batch, never to a worker already running it, never when no other worker has a seat free."""

from __future__ import annotations

import time

import msgspec
import pytest

from switchyard.gateway.hedging import AUTO_MIN_SAMPLES, BUDGET_BURST, Hedging
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.shared import subjects
from switchyard.shared.messages import EmbedInput, GenerateRequest, SamplingParams, WorkerInfo
from switchyard.shared.tiers import DEFAULT_POLICIES


class Policies:
    def __init__(self, **changes) -> None:
        self.policies = {tier: msgspec.structs.replace(p, **changes) for tier, p in DEFAULT_POLICIES.items()}

    async def get(self):
        return self.policies


class Registry:
    def __init__(self, *workers: WorkerInfo, joined: tuple[WorkerInfo, ...] = ()) -> None:
        self.workers = list(workers)
        self.joined = list(joined)  # in the KV bucket, not yet in the cached listing

    async def models(self, fresh: bool = False):
        return {"m": self.workers + self.joined if fresh else self.workers}


class Liveness:
    def __init__(self, **free: int) -> None:
        self.free = free

    def free_seats(self, worker_id: str) -> int:
        return self.free.get(worker_id, 0)


class Publisher:
    def __init__(self) -> None:
        self.published: list[tuple[GenerateRequest, str, str]] = []

    async def publish(self, request, payload=None, *, subject=None, msg_id=None, within_s=0.0):
        self.published.append((request, subject, msg_id))
        return 1


def worker(worker_id: str, role: str = "both", draining: bool = False) -> WorkerInfo:
    return WorkerInfo(worker_id, "m", 4096, 0.0, role=role, draining=draining)


def request(tier: str = "enterprise", **kw) -> GenerateRequest:
    return GenerateRequest("r1", "m", tier, SamplingParams(max_tokens=8), created_at=time.time(),
                           deadline_at=time.time() + 30, prompt="x", **kw)


def hedging(policies=None, registry=None, liveness=None, metrics=None) -> tuple[Hedging, Publisher]:
    publisher = Publisher()
    made = Hedging(policies or Policies(hedge_after_ms=300), registry or Registry(worker("a"), worker("b")),
                   liveness or Liveness(a=4, b=4), publisher, metrics)  # type: ignore[arg-type]
    return made, publisher


async def test_a_hedged_tier_hedges_after_its_delay_on_the_worker_with_the_most_free_seats_but_not_the_one_running_it():
    metrics = GatewayMetrics()
    metrics.served_models.add("m")
    registry = Registry(worker("a"), worker("b"), worker("c"), worker("p", role="prefill"), worker("d", draining=True))
    hedge, publisher = hedging(registry=registry, liveness=Liveness(a=9, b=1, c=3, p=9, d=9), metrics=metrics)
    req = request()
    assert await hedge.delay(req) == pytest.approx(0.3)
    placed = await hedge.offer(req, running_on=["a"])
    assert placed is not None and placed[0] == "c"  # a runs it; p prefills only; d drains; c has more than b
    (offer, subject, msg_id), = publisher.published
    assert subject == subjects.affinity_subject("c", "enterprise") and msg_id == "r1.hedge0"
    assert offer.affinity_until == placed[1] and offer.request_id == "r1"  # the same request, offered for a while
    assert metrics.hedges_started.labels("m", "enterprise")._value.get() == 1


async def test_no_hedge_without_a_free_seat_elsewhere():
    metrics = GatewayMetrics()
    hedge, publisher = hedging(liveness=Liveness(a=5, b=0), metrics=metrics)
    req = request()
    await hedge.delay(req)
    assert await hedge.offer(req, running_on=["a"]) is None and publisher.published == []
    assert metrics.hedges_skipped.labels("", "enterprise", "no_free_seat")._value.get() == 1


async def test_a_worker_that_joined_since_the_cached_listing_takes_the_hedge():
    hedge, publisher = hedging(registry=Registry(worker("a"), joined=(worker("b"),)), liveness=Liveness(a=4, b=4))
    req = request()
    await hedge.delay(req)
    placed = await hedge.offer(req, running_on=["a"])
    assert placed is not None and placed[0] == "b" and len(publisher.published) == 1


async def test_the_budget_bounds_hedges_to_its_share_of_the_tiers_requests():
    hedge, publisher = hedging(policies=Policies(hedge_after_ms=300, hedge_budget=0.1))
    placed = 0
    for _ in range(200):
        req = request()
        await hedge.delay(req)
        placed += await hedge.offer(req, running_on=["a"]) is not None
    # Every request is due a hedge here: a tenth of them get one, and the few a gateway starts with.
    assert 20 <= placed <= 20 + BUDGET_BURST


@pytest.mark.parametrize("req", [
    request(tier="batch"),
    request(embed=EmbedInput(["x"])),
    request(handover=True),
    request(tier="pro"),
], ids=["batch", "embeddings", "prefill", "tier-off"])
async def test_some_requests_are_never_hedged(req):
    policies = Policies(hedge_after_ms=300)  # every tier, even batch (tiers set refuses it)
    policies.policies["pro"] = DEFAULT_POLICIES["pro"]  # hedging off
    hedge, _ = hedging(policies=policies)
    assert await hedge.delay(req) is None


async def test_auto_hedges_after_the_tiers_recent_ttft_p95_once_it_has_seen_enough():
    hedge, _ = hedging(policies=Policies(hedge_after_ms="auto"))
    req = request()
    assert await hedge.delay(req) is None  # nothing seen yet: nothing is known to be slow
    for i in range(AUTO_MIN_SAMPLES * 5):  # 0.01 s .. 1.00 s
        hedge.first_token(req, (i + 1) / 100)
    assert await hedge.delay(req) == pytest.approx(0.95)
    assert await hedge.delay(request(tier="pro")) is None  # another tier's window is its own
