"""What a gateway does when the worker running one of its requests dies mid-stream.

    worker A dies ──(no liveness ping for 3 s)──▶ relay: a cancel addressed to A's run of this attempt (if A only
                  stalled, it stops that run and bills nothing) ──▶ Failover.continue_elsewhere:
        the request is published again with ``resume`` = the tokens streamed so far and a fresh queue deadline (its
        tier's wait). The next worker of the model to pull it (another live one, A's replacement, or A back from a
        stall) prefills prompt + those tokens, streams on from the next token and bills the whole request.
        None by that deadline: Failover.bill_lost writes a usage record for what A streamed, and the client gets
        an explicit ``worker_lost`` error.

A model served by one worker thus loses no request to that worker's crash or stall when it is back (restarted by
its supervisor) within the tier's wait, as a queued request waits for it. Only a request with ``n == 1`` is
continued: its deltas carry every generated token id, in order. A request with several choices or tools ends with
``worker_lost`` at once (and its streamed tokens billed), as do continuations beyond ``max_attempts``. Usage records
are deduplicated by request id (the message id, then the table's key), so a request is billed once whoever writes
its record.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import msgspec
from nats.js import JetStreamContext

from switchyard.domain.publish import RequestPublisher
from switchyard.gateway.kv_index import KVIndex
from switchyard.shared import subjects
from switchyard.shared.jetstream import publish_once
from switchyard.shared.messages import GenerateRequest, KVSource, Resume, UsageRecord, encode

log = logging.getLogger("switchyard.gateway")


class Failover:
    """Continues requests of dead workers on live ones; one per gateway, shared by every relayed request."""

    def __init__(self, js: JetStreamContext, publisher: RequestPublisher, max_attempts: int = 2,
                 kv_index: KVIndex | None = None) -> None:
        """``js`` bills what a dead worker streamed (the USAGE stream); ``publisher`` queues continuations;
        ``kv_index``: the fleet's KV index, when placement uses it (a hand-over names the node holding the
        prefill's blocks)."""
        self._js = js
        self._publisher = publisher
        self._max_attempts = max_attempts
        self._kv_index = kv_index

    async def continue_elsewhere(self, request: GenerateRequest, dead_worker: str | None, token_ids: list[int],
                                 text_len: int) -> GenerateRequest | None:
        """Publish ``request`` again to go on after ``token_ids`` (whose text the client has ``text_len``
        characters of) on the next worker of its model to pull it (``dead_worker``, taken for dead, is named in the
        log; None: a broken stream's); returns the continuation, or None when it cannot be continued."""
        resume = request.resume
        failures = (resume.attempt - resume.handovers if resume is not None else 0) + 1
        # An embeddings request's vectors do not continue from where a client is, nor does a request a worker would
        # refuse to resume (GenerateRequest.continuable): they end with worker_lost.
        if not request.continuable or request.embed is not None or failures > self._max_attempts:
            return None
        # Published whether or not another worker is live now: the continuation waits in the queue until its
        # deadline, as any request does, for a replacement (a supervisor restarts a crashed worker in seconds), the
        # dead worker back from a stall, or a registry that lists none yet right after a NATS restart.
        continuation = await self._publish_continuation(request, token_ids, text_len, handover=False)
        if continuation is not None:
            log.warning("continuing request %s after %d tokens (failure %d; worker %s dead or its stream broken)",
                        request.request_id, len(token_ids), failures, dead_worker)
        return continuation

    async def hand_over(self, request: GenerateRequest, token_ids: list[int], text_len: int,
                        prefill_worker: str | None, kv_transfer: dict[str, Any] | None = None,
                        ) -> GenerateRequest | None:
        """A prefill worker ended its part of ``request`` after ``token_ids``: publish it to go on on a
        whole-request (decode) worker, which loads the prompt's blocks from the shared KV tier; returns the
        continuation, or None when it could not be queued. A hand-over is no failure: it takes none of the
        request's ``max_attempts``. ``prefill_worker`` and ``kv_transfer`` (a vLLM prefill's connector parameters)
        go with it in its ``Resume``."""
        kv_source = self._kv_index.source(request) if self._kv_index is not None else None
        return await self._publish_continuation(request, token_ids, text_len, handover=True, kv_source=kv_source,
                                                prefill_worker=prefill_worker, kv_transfer=kv_transfer)

    async def _publish_continuation(self, request: GenerateRequest, token_ids: list[int], text_len: int,
                                    handover: bool, kv_source: KVSource | None = None,
                                    prefill_worker: str | None = None, kv_transfer: dict[str, Any] | None = None,
                                    ) -> GenerateRequest | None:
        resume = request.resume
        attempt = request.attempt + 1
        handovers = (resume.handovers if resume is not None else 0) + handover
        # A failover after the hand-over still names the prefill worker (for the usage record), but not its
        # connector's blocks: they may be gone, and the next worker computes or loads the prompt itself.
        prefill_worker = prefill_worker or (resume.prefill_worker if resume is not None else None)
        continuation = msgspec.structs.replace(
            request, resume=Resume(list(token_ids), text_len, attempt, handovers, prefill_worker, kv_transfer),
            handover=False,
            affinity_until=0.0, kv_source=kv_source or request.kv_source,
            deadline_at=time.time() + max(1.0, request.deadline_at - request.created_at))
        try:
            # Its own message id: the original's is still in the stream's duplicate window.
            await self._publisher.publish(continuation, msg_id=f"{request.request_id}.resume{attempt}")
        except Exception as exc:  # queue full, or NATS away: the request ends with worker_lost
            log.warning("could not continue request %s elsewhere: %r", request.request_id, exc)
            return None
        return continuation

    async def bill_lost(self, request: GenerateRequest, worker_id: str | None, prompt_tokens: int,
                        completion_tokens: int, taken_at: float | None, first_token_at: float | None) -> None:
        """The usage record of a request that ended with its worker dead: the tokens it streamed are billed."""
        now = time.time()
        record = UsageRecord(
            request_id=request.request_id, model=request.model, tier=request.tier, prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens, finish_reason="error", created_at=request.created_at,
            queue_ms=((taken_at or now) - request.created_at) * 1000,
            first_token_ms=None if first_token_at is None else (first_token_at - request.created_at) * 1000,
            total_ms=(now - request.created_at) * 1000, tenant_id=request.tenant_id, api_key_id=request.api_key_id,
            worker_id=worker_id, end_user=request.end_user, metadata=request.metadata,
            prefill_worker_id=request.resume.prefill_worker if request.resume is not None else None)
        try:
            await publish_once(self._js, subjects.USAGE_SUBJECT, encode(record), request.request_id, within_s=30.0)
        except Exception:
            log.exception("could not record the usage of %s, whose worker died", request.request_id)
