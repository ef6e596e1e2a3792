"""Publish a request to JetStream and relay the worker's token deltas back.

    gateway                      NATS                               worker
      │ open an inbox (TokenRouter)│                                   │
      │ publish llm.req.<m>.<tier> │──── JetStream REQUESTS ──────────▶│ (pull when it can admit)
      │◀── llm.tok.gw.<gateway>: first delta (taken), then one per step, with the step's other deltas to us ──│
      │ llm.cancel.<id> on disconnect ───────────────────────────────▶│

Opening the inbox before publishing means no delta can be missed, however fast the worker is.
"""

from __future__ import annotations

import time

import msgspec
from nats.aio.client import Client as NATS

from switchyard.domain.publish import QueueFull, RequestPublisher
from switchyard.gateway.failover import Failover
from switchyard.gateway.hedging import Hedging
from switchyard.gateway.liveness import WorkerLiveness
from switchyard.gateway.relayed_request import RelayedRequest
from switchyard.gateway.token_router import DeltaInbox, TokenRouter
from switchyard.shared import subjects
from switchyard.shared.messages import (
    GenerateRequest,
    ResumeAnswer,
)

# An offer's fallback waits this long past the offer's own end, so a worker whose clock runs a little behind the
# gateway's has dropped its copy by the time the request goes to the shared queue.
OFFER_GRACE_S = 0.1


class Relay:
    """Submits requests; one per gateway process, shared by all handlers."""

    def __init__(self, nc: NATS, router: TokenRouter, publisher: RequestPublisher, stall_timeout_s: float,
                 retry_after_s: int, liveness: WorkerLiveness | None = None, failover: Failover | None = None,
                 hedging: Hedging | None = None) -> None:
        """``router``: this process's token subject, started (its deltas come there)."""
        self._nc = nc
        self._router = router
        self._publisher = publisher
        self._liveness = liveness
        self._failover = failover
        self._hedging = hedging
        self._stall_timeout_s = stall_timeout_s
        self._retry_after_s = retry_after_s

    async def submit(self, request: GenerateRequest, offer_to: str | None = None,
                     offer_s: float = 0.5, prefill: bool = False) -> RelayedRequest:
        """Publish ``request``; raises OpenAIError 429 ``queue_full`` when JetStream refuses it, 413
        ``request_too_large`` when it does not fit in one NATS message.

        ``offer_to``: a worker that holds the request's prefix (gateway/affinity.py). The request is offered to it
        alone first; if no first message comes within ``offer_s``, it goes to the shared queue too (the worker
        drops an offer it finds past its time, and a rare double start is dismissed like any other).
        ``prefill``: the request is offered, the same way, to its model's prefill pool, to be handed over to a
        decode worker after its first token (disaggregated serving)."""
        request = msgspec.structs.replace(request, reply_subject=self._router.subject)
        payload = self._publisher.encode(request)
        delay = None if prefill or self._hedging is None else await self._hedging.delay(request)
        inbox = self._router.open(request.request_id)
        relayed = RelayedRequest(self._nc, request, inbox, self._stall_timeout_s, self._retry_after_s,
                                 self._liveness, self._failover, self._hedging,
                                 None if delay is None else request.created_at + delay)
        try:
            if not prefill and offer_to is None:
                await self._publish(request, payload)
            else:  # an offer (its own message id: the fallback's is the request's), then the shared queue
                offer = msgspec.structs.replace(request, affinity_until=time.time() + offer_s, handover=prefill)
                # A prefill offer's subject is its model's prefill queue (the publisher's, for ``handover``).
                subject = None if prefill or offer_to is None else subjects.affinity_subject(offer_to, request.tier)
                await self._publish(offer, subject=subject,
                                    msg_id=f"{request.request_id}.{'prefill' if prefill else 'offer'}")
                relayed.fall_back(offer.affinity_until + OFFER_GRACE_S, lambda: self._publish(request, payload))
        except BaseException:
            await relayed.close()
            raise
        return relayed

    def taken_over(self, request: GenerateRequest, inbox: DeltaInbox, answer: ResumeAnswer) -> RelayedRequest:
        """A stream this gateway took over (gateway/stream_resume.py): the answering worker runs ``request`` and
        resends its deltas from ``answer.first_seq`` to ``inbox``, after ``answer.token_ids`` of its run; it goes
        on (failovers included) as if it had started here."""
        request = msgspec.structs.replace(request, reply_subject=self._router.subject)
        relayed = RelayedRequest(self._nc, request, inbox, self._stall_timeout_s, self._retry_after_s,
                                 self._liveness, self._failover)
        relayed.state.taken_over(answer.worker_id, answer.first_seq, answer.next_seq)
        relayed.had_before(answer.token_ids, answer.text_len)
        return relayed

    @property
    def token_subject(self) -> str:
        return self._router.subject

    def open_inbox(self, request_id: str) -> DeltaInbox:
        return self._router.open(request_id)

    def inbox_of(self, request_id: str) -> DeltaInbox | None:
        """The inbox this gateway has open for ``request_id``: it relays that request already."""
        return self._router.inbox_of(request_id)

    async def _publish(self, request: GenerateRequest, payload: bytes | None = None, **where) -> None:
        try:
            await self._publisher.publish(request, payload, **where)
        except QueueFull:
            await self._publisher.count_refusal(request)  # a 429 the client gets
            raise
