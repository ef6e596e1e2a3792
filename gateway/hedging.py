"""Hedged requests: a request of a hedged tier with no token some time after it was accepted is offered to a
second worker too, and whichever produces a token first serves it (the state machine of gateway/relay_state.py).

    accepted ──▶ delay(request): the tier's hedge_after_ms, or with "auto" the tier's recent TTFT p95 on the model
             ──▶ relay: running on worker A, no token by then ──▶ offer(request, A):
                     the tier's budget has a hedge left?  (each request adds hedge_budget of one, up to 3)
                     a live worker B ≠ A of the model, taking whole requests, with a seat free at its last ping?
                     yes: the same attempt offered to B alone (llm.aff.<B>.<tier>), for HEDGE_OFFER_S
                     no:  not hedged (with no seat free anywhere a hedge only adds load)
             ──▶ the first token of A or B: the other is dismissed (it bills nothing; the worker counts what it
                 computed in switchyard:worker_dismissed_tokens_total), hedges_won or hedges_lost counted

What a stalled worker (a GC pause, a noisy neighbour, a stuck host) costs a premium request becomes the hedge
delay plus a prefill elsewhere, not the stall. The budget is per gateway: each gateway hedges at most that share of
the requests it accepts.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from collections.abc import Collection

import msgspec

from switchyard.domain.publish import RequestPublisher
from switchyard.domain.registry import ModelRegistry
from switchyard.gateway.liveness import WorkerLiveness
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.shared import subjects
from switchyard.shared.messages import GenerateRequest
from switchyard.shared.tier_store import PolicyCache
from switchyard.shared.tiers import BATCH_TIER

log = logging.getLogger("switchyard.gateway")

# A hedge offer its worker has not taken by then is dropped there: that worker had no seat after all.
HEDGE_OFFER_S = 1.0
# "auto": the p95 of this many recent first-token latencies of the tier on the model, once there are enough.
AUTO_WINDOW = 200
AUTO_MIN_SAMPLES = 20
# Hedges a tier may start at once beyond its share (a budget saved while nothing needed one; a gateway starts
# with it).
BUDGET_BURST = 3.0
_PUBLISH_S = 0.5  # a hedge that cannot be queued this fast is not worth waiting for: the first run goes on


class Hedging:
    """When to hedge a request and where; one per gateway, shared by every relayed request."""

    def __init__(self, policies: PolicyCache, registry: ModelRegistry, liveness: WorkerLiveness,
                 publisher: RequestPublisher, metrics: GatewayMetrics | None = None) -> None:
        self._policies = policies
        self._registry = registry
        self._liveness = liveness
        self._publisher = publisher
        self._metrics = metrics
        self._first_tokens: dict[tuple[str, str], deque[float]] = {}  # (model, tier) -> recent TTFTs, seconds
        self._credit: dict[str, float] = {}  # tier -> hedges it may start now

    async def delay(self, request: GenerateRequest) -> float | None:
        """Seconds after ``request`` was accepted at which to hedge it if it has no token by then; None: never.
        Each request asked about adds its share to its tier's budget."""
        if request.tier == BATCH_TIER or request.embed is not None or request.handover:
            return None
        policy = (await self._policies.get()).get(request.tier)
        if policy is None or policy.hedge_after_ms == 0:
            return None
        self._credit[request.tier] = min(BUDGET_BURST,
                                         self._credit.get(request.tier, BUDGET_BURST) + policy.hedge_budget)
        if policy.hedge_after_ms == "auto":
            return self._recent_p95(request.model, request.tier)
        return policy.hedge_after_ms / 1000

    def first_token(self, request: GenerateRequest, ttft_s: float) -> None:
        """``request``'s first token came ``ttft_s`` after it was accepted (what "auto" hedges by)."""
        window = self._first_tokens.setdefault((request.model, request.tier), deque(maxlen=AUTO_WINDOW))
        window.append(ttft_s)

    def _recent_p95(self, model: str, tier: str) -> float | None:
        window = self._first_tokens.get((model, tier))
        if window is None or len(window) < AUTO_MIN_SAMPLES:
            return None  # too little seen to know what is slow
        ordered = sorted(window)
        return ordered[min(len(ordered) - 1, math.ceil(0.95 * len(ordered)) - 1)]

    async def offer(self, request: GenerateRequest, running_on: Collection[str]) -> tuple[str, float] | None:
        """Offer ``request`` to a second worker, none of ``running_on``; returns that worker and when its offer
        ends, or None when there is no budget left or no seat free anywhere else."""
        if self._credit.get(request.tier, 0.0) < 1.0 - 1e-9:  # a share summed n times is a hair short of 1
            self._count_skipped(request, "budget")
            return None
        target = await self._free_worker(request.model, running_on)
        if target is None:
            self._count_skipped(request, "no_free_seat")
            return None
        offer = msgspec.structs.replace(request, affinity_until=time.time() + HEDGE_OFFER_S)
        try:
            await self._publisher.publish(offer, subject=subjects.affinity_subject(target, request.tier),
                                          msg_id=f"{request.request_id}.hedge{request.attempt}", within_s=_PUBLISH_S)
        except Exception as exc:  # queue full or NATS away: the first run goes on alone
            log.warning("could not hedge request %s: %r", request.request_id, exc)
            return None
        self._credit[request.tier] -= 1.0
        if self._metrics is not None:
            self._metrics.hedges_started.labels(self._metrics.model_label(request.model), request.tier).inc()
        log.info("request %s: no token yet on %s; hedged on %s", request.request_id, ", ".join(running_on), target)
        return target, offer.affinity_until

    def decided(self, request: GenerateRequest, hedge_won: bool) -> None:
        """A hedged request's first token came from the second worker (``hedge_won``) or the first."""
        if self._metrics is not None:
            counter = self._metrics.hedges_won if hedge_won else self._metrics.hedges_lost
            counter.labels(self._metrics.model_label(request.model), request.tier).inc()

    async def _free_worker(self, model: str, running_on: Collection[str]) -> str | None:
        """The live worker of ``model`` with the most seats free, none of ``running_on``, or None. The cached
        listing first; when it has none, a fresh one: a worker that joined within the cache's second is the one
        a stalled request most likely needs, and a hedge is rare enough to pay the read."""
        for fresh in (False, True):
            try:
                workers = (await self._registry.models(fresh=fresh)).get(model, [])
            except Exception:  # the registry unreadable: no hedge, the request goes on where it runs
                return None
            free = [(self._liveness.free_seats(w.worker_id), w.worker_id) for w in workers
                    if w.takes_whole_requests and w.worker_id not in running_on]
            seats, worker = max(free, default=(0, None))
            if seats > 0:
                return worker
        return None

    def _count_skipped(self, request: GenerateRequest, reason: str) -> None:
        if self._metrics is not None:
            self._metrics.hedges_skipped.labels(self._metrics.model_label(request.model), request.tier,
                                                reason).inc()
