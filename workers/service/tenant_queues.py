"""One worker's view of its model's request queues: a queue per tier and tenant, and which to pull from next.

    llm.req.<model>.<tier>.<tenant>  ──  durable consumer req-<model>-<tier>-<tenant> (shared by the model's workers)
    llm.aff.<worker>.<tier>          ──  durable consumer aff-<worker>-<tier>: requests offered to this worker alone
                                         because it holds their prefix (gateway/affinity.py); taken first in a tier

Which tenants have requests queued is learnt from the doorbell (every publish on ``llm.req.<model>.>`` reaches
the worker's core subscription too) and, for what rings no bell (redeliveries, requests queued before the worker
started, bells lost on the way), from a sweep of the stream's per-subject counts. Within a tier the backlogged
tenant that was served least goes first (scheduler/tenant_share.py); between tiers the worker's weighted tier
share decides. A consumer is made when a tenant first has work here, and again when a pull finds it gone
(JetStream deletes a consumer nobody pulled from for ten minutes, and the worker forgets its name then too,
consumer_names.py); every pull goes through one subscription (pulls.py), so a thousand active tenants cost the
worker no subscription each.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from nats.js import JetStreamContext

from switchyard.scheduler.pausing import ahead_in_share
from switchyard.scheduler.tenant_share import TenantShare
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_affinity_consumer, ensure_request_consumer, queued_tenants
from switchyard.workers.service.consumer_names import ConsumerNames
from switchyard.workers.service.prepare_cost import is_cheap_message
from switchyard.workers.service.pulls import ConsumerGone, ConsumerPulls

log = logging.getLogger("switchyard.worker")


class TenantQueues:
    def __init__(self, nc, js: JetStreamContext, model: str, tiers: list[str], worker_id: str = "") -> None:
        self._js = js
        self._pulls = ConsumerPulls(nc)
        self._model = model
        self._worker_id = worker_id
        self._offered: set[str] = set()  # tiers with requests offered to this worker
        self._tiers = list(tiers)
        self._pending: dict[str, set[str]] = {t: set() for t in tiers}  # tier -> tenant tokens that may have work
        self._shares: dict[str, TenantShare] = {t: TenantShare() for t in tiers}
        self._consumers = ConsumerNames()  # (tier, tenant) -> (stream, consumer) made
        # (tier, tenant) -> the number of its last doorbell (see ``_emptied``); only for tenants pending
        self._rung: dict[tuple[str, str], int] = {}
        # (tier, tenant) -> its doorbells not yet matched by a request taken here (see ``_took_last``); only for
        # tenants pending
        self._unmatched: dict[tuple[str, str], int] = {}
        self._rings = itertools.count(1)

    # -- what may be queued -----------------------------------------------------------------------------------
    def ring(self, subject: str) -> bool:
        """A doorbell: a request was published on ``subject``; True when it is one of this model's queues."""
        parts = subject.split(".")
        if len(parts) == 4 and parts[2] == self._worker_id and parts[3] in self._pending:  # llm.aff.<me>.<tier>
            self._offered.add(parts[3])
            return True
        key = self._queue_of(subject)
        if key is None:
            return False
        self._pending[key[0]].add(key[1])
        self._rung[key] = next(self._rings)
        self._unmatched[key] = self._unmatched.get(key, 0) + 1
        return True

    def _queue_of(self, subject: str) -> tuple[str, str] | None:
        """(tier, tenant token) of a request subject of this model's tenant queues, else None."""
        parts = subject.split(".")
        if len(parts) != 5 or parts[3] not in self._pending:
            return None
        return parts[3], parts[4]

    async def sweep(self, taken_subjects: Iterable[str] = ()) -> None:
        """Every tenant with requests in the stream, whatever rang. ``taken_subjects``: the subjects of requests
        this worker took and has not acknowledged yet; the stream still counts them, but they are not there to be
        pulled (counting them, a tenant whose last request is being prepared would come back into the order with
        every sweep, and its empty answer would hold up the next tenant to ring)."""
        taken = Counter(filter(None, map(self._queue_of, taken_subjects)))
        for tier in self._tiers:
            try:
                counts = await queued_tenants(self._js, self._model, tier)
            except Exception as exc:  # NATS reconnecting: the next sweep sees them
                log.debug("sweep of %s failed: %r", tier, exc)
                continue
            self._pending[tier].update(t for t, n in counts.items() if n > taken[(tier, t)])
        if self._worker_id:
            try:
                info = await self._js.stream_info(subjects.AFFINITY_STREAM,
                                                  subjects_filter=subjects.affinity_subject(self._worker_id, "*"))
                self._offered.update(s.rsplit(".", 1)[-1] for s, n in (info.state.subjects or {}).items() if n)
            except Exception as exc:
                log.debug("sweep of offers failed: %r", exc)

    def pending_tiers(self) -> set[str]:
        return {tier for tier, tenants in self._pending.items() if tenants} | self._offered

    def has_work(self, tier: str, excluded: AbstractSet[str], offers: bool = True,
                 pause_over: AbstractSet[str] | None = None) -> bool:
        """Whether ``tier`` may have a request for a tenant not in ``excluded``, or an offer when ``offers`` (not
        when a seat is taken for fairness: that is a tenant's turn, not an offer's). ``pause_over``: the pull would
        pause a request of one of these tenants; only a tenant ahead of them all in the tier's share counts."""
        candidates = self._pending[tier] - excluded
        if pause_over is not None:
            self._shares[tier].set_backlogged(self._pending[tier])
            candidates = self._ahead(tier, candidates, pause_over)
        return bool(candidates) or (tier in self._offered and offers)

    def _ahead(self, tier: str, tenants: AbstractSet[str], pause_over: AbstractSet[str]) -> set[str]:
        """Of ``tenants``, those whose next request would be done, in the tier's fair-share virtual time, before
        any tenant of ``pause_over`` has been served so far (scheduler/pausing.ahead_in_share)."""
        share = self._shares[tier]
        counters = [share.counter(t) for t in pause_over]
        return {t for t in tenants if ahead_in_share(share.finish_tag(t), counters)}

    def has_pending(self) -> bool:
        return any(self._pending.values()) or bool(self._offered)

    def tenant_state(self) -> dict[str, int]:
        """Entries per tenant (and tier), every tier's fair share included (shared/tenant_state.py). Read from the
        status server's thread: the tiers' maps never change, only the sets and maps in them."""
        sizes = Counter({"queue_pending_tenants": sum(len(tenants) for tenants in self._pending.values()),
                         "queue_rings": len(self._rung), "queue_unmatched": len(self._unmatched),
                         "queue_consumers": len(self._consumers)})
        for share in self._shares.values():
            sizes.update(share.tenant_state())
        return dict(sizes)

    def summary(self) -> dict[str, int]:
        """Tier -> tenants that may have work, offers counted as one (for the worker's state line)."""
        return {tier: len(tenants) + (tier in self._offered) for tier, tenants in self._pending.items()
                if tenants or tier in self._offered}

    # -- taking ---------------------------------------------------------------------------------------------
    async def take(self, tier: str, timeout_s: float, excluded: AbstractSet[str] = frozenset(), offers: bool = True):
        """One request message of ``tier``: an offer first when ``offers``, else from the least served of its
        tenants that has one (``excluded`` tenants aside); None when none had (each tenant that came up empty is
        forgotten until it rings again, or the next sweep finds it)."""
        msgs = await self.take_many(tier, 1, timeout_s, excluded, offers)
        return msgs[0] if msgs else None

    async def take_many(self, tier: str, count: int, timeout_s: float, excluded: AbstractSet[str] = frozenset(),
                        offers: bool = True, pause_over: AbstractSet[str] | None = None) -> list:
        """Up to ``count`` request messages of ``tier``, one each from the least served tenants that have one, in
        that order (pulled side by side: a worker with many free seats fills them at the pace of NATS, not of one
        round trip per request); then, with seats still to fill, more from those that said they have more (least
        served first, shared evenly: one tenant's burst fills free seats a batch per round trip); an offer to this
        worker first when ``offers``. ``pause_over``: see ``has_work``."""
        got = []
        if tier in self._offered and offers:  # a request whose prefix this worker holds comes first
            msg = await self._fetch(("offer", tier), timeout_s)
            if msg is not None:
                got.append(msg)
            else:
                self._offered.discard(tier)
        share = self._shares[tier]
        tenants = self._pending[tier]
        asked_before: set[str] = set()
        with_more: dict[str, int] = {}  # tenant -> what its consumer said it had left after its last message here
        while len(got) < count:
            # The order again each round: a tenant that rang while the last round's pulls were out (a light one,
            # ranked first) is asked now, not after every tenant the first order named.
            share.set_backlogged(tenants)
            candidates = tenants - excluded - asked_before
            if pause_over is not None:
                candidates = self._ahead(tier, candidates, pause_over)
            if not candidates:
                break
            asked = share.order(candidates)[:count - len(got)]
            asked_before.update(asked)
            rung_before = next(self._rings)
            answers = await asyncio.gather(*(self._fetch((tier, tenant), timeout_s) for tenant in asked))
            for tenant, msg in zip(asked, answers):
                if msg is not None:
                    got.append(msg)
                    # More of a tenant only after a cheap request: what the batch holds then is bounded by its
                    # bytes (pulls.MORE_MAX_BYTES), and the tenant is taken one at a time again once it has a
                    # costly one in preparation (capacity.py).
                    with_more[tenant] = (_num_pending(msg) or 0) if is_cheap_message(msg.data) else 0
                    if self._took_last(tier, tenant, msg) and self._rung.get((tier, tenant), 0) < rung_before:
                        self._emptied(tier, tenant)
                elif self._rung.get((tier, tenant), 0) < rung_before:
                    self._emptied(tier, tenant)
        more = [(tenant, left) for tenant, left in with_more.items() if left > 0 and tenant not in excluded]
        if len(got) < count and more and pause_over is None:  # a pull to pause for is one request, judged alone
            got += await self._take_more(tier, more, count - len(got), timeout_s)
        return got

    async def _take_more(self, tier: str, tenants: list[tuple[str, int]], count: int, timeout_s: float) -> list:
        """Up to ``count`` more messages from ``tenants`` ((tenant, what it has left), least served first), shared
        evenly, each tenant's in one pull that the server answers at once."""
        share, extra = divmod(count, len(tenants))
        asks = [(tenant, min(left, share + (i < extra))) for i, (tenant, left) in enumerate(tenants)]
        asks = [(tenant, n) for tenant, n in asks if n > 0]
        rung_before = next(self._rings)
        answers = await asyncio.gather(*(self._fetch_more((tier, tenant), n, timeout_s) for tenant, n in asks))
        got = []
        for (tenant, _), msgs in zip(asks, answers):
            for msg in msgs:
                got.append(msg)
                if self._took_last(tier, tenant, msg) and self._rung.get((tier, tenant), 0) < rung_before:
                    self._emptied(tier, tenant)
        return got

    def _took_last(self, tier: str, tenant: str, msg) -> bool:
        """Whether ``msg`` was ``tenant``'s last request in ``tier``, so that asking again would only wait out an
        empty answer (``PULL_EXPIRES_S``, during which the intake pulls for nobody else: the next tenant to ring
        would wait for it). JetStream says how many it left in the consumer; but a doorbell can come before the stream
        hands its request to the consumer (sooner still in a cluster, where the stream commits first), so a tenant
        with more doorbells than requests taken here stays in the order and is asked again, at a pull's usual wait.
        Where other workers take some of a tenant's requests, its doorbells outnumber what this one took, and an
        empty answer ends its turn."""
        key = (tier, tenant)
        unmatched = self._unmatched.get(key, 0)
        if unmatched:
            self._unmatched[key] = unmatched - 1
        return unmatched <= 1 and _num_pending(msg) == 0

    def _emptied(self, tier: str, tenant: str) -> None:
        """``tenant``'s queue in ``tier`` has nothing more (an empty answer, or its last request taken): it leaves
        the order until it rings again. A ring newer than the pull that came back empty wins: that request may
        have reached the stream after the pull expired."""
        self._pending[tier].discard(tenant)
        self._shares[tier].drained(tenant)
        self._rung.pop((tier, tenant), None)
        self._unmatched.pop((tier, tenant), None)

    async def _fetch(self, key: tuple[str, str], timeout_s: float):
        """One message from a queue's consumer, or None (empty, or failed: the consumer is made again when a pull
        finds it gone, and a pull that failed otherwise (NATS away) is simply empty this time)."""
        for _ in range(2):
            try:
                stream, consumer = await self._consumer(*key)
                return await self._pulls.next(stream, consumer, timeout_s)
            except ConsumerGone:
                self._consumers.pop(key)  # deleted while idle, or a fresh server: made again, once
            except Exception as exc:
                # A JetStream refusal names its cause in its description (a consumer limit, a stream gone).
                log.warning("fetch from %s failed: %r %s", "/".join(key), exc, getattr(exc, "description", "") or "")
                self._consumers.pop(key)
                return None
        return None

    async def _fetch_more(self, key: tuple[str, str], count: int, timeout_s: float) -> list:
        """Up to ``count`` more messages from a queue's consumer that answered a pull just now (none, on a
        failure: the next round asks again)."""
        known = self._consumers.get(key)
        if known is None:
            return []
        try:
            return await self._pulls.more(*known, count, timeout_s)
        except Exception as exc:
            log.warning("fetch from %s failed: %r", "/".join(key), exc)
            return []

    def charge(self, tier: str, tenant: str | None, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        """Service given to a tenant of ``tier`` (admission: its prompt; each step: what it generated)."""
        share = self._shares.get(tier)
        if share is not None:
            share.charge(subjects.tenant_token(tenant), prompt_tokens, generated_tokens)

    def finished(self, tier: str, tenant: str | None, prompt_tokens: int, generated_tokens: int) -> None:
        """A request of ``tenant`` in ``tier`` ended: how much its next one is expected to cost (tenant_share.py)."""
        share = self._shares.get(tier)
        if share is not None:
            share.finished(subjects.tenant_token(tenant), prompt_tokens, generated_tokens)

    async def close(self) -> None:
        await self._pulls.close()

    async def _consumer(self, tier: str, tenant: str) -> tuple[str, str]:
        key = (tier, tenant)
        known = self._consumers.get(key)
        if known is not None:
            return known
        if tier == "offer":  # (tier, tenant) is ("offer", tier) for this worker's offers
            known = (subjects.AFFINITY_STREAM, await ensure_affinity_consumer(self._js, self._worker_id, tenant))
        else:
            # The consumer is named after the token, which is what the subject carries: make it for that token.
            known = (subjects.request_stream(tier), await ensure_request_consumer(self._js, self._model, tier, tenant))
        self._consumers.put(key, known)
        return known


def _num_pending(msg) -> int | None:
    """Requests left in the consumer after ``msg`` (JetStream puts the count in the reply subject); None when the
    reply names none."""
    try:
        return msg.metadata.num_pending
    except Exception:  # not a JetStream delivery's reply: no count, so no conclusion
        return None
