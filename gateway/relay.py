"""Publish a request to JetStream and relay the worker's token deltas back.

    gateway                      NATS                               worker
      │ open an inbox (TokenRouter)│                                   │
      │ publish llm.req.<m>.<tier> │──── JetStream REQUESTS ──────────▶│ (pull when it can admit)
      │◀── llm.tok.gw.<gateway>: first delta (taken), then one per step, with the step's other deltas to us ──│
      │ llm.cancel.<id> on disconnect ───────────────────────────────▶│

Opening the inbox before publishing means no delta can be missed, however fast the worker is.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError

from switchyard.domain.errors import OpenAIError, service_unavailable
from switchyard.domain.publish import QueueFull, RequestPublisher
from switchyard.gateway.failover import Failover
from switchyard.gateway.liveness import WorkerLiveness
from switchyard.gateway.token_router import DeltaInbox, TokenRouter
from switchyard.shared import subjects
from switchyard.shared.messages import HANDOVER, ErrorInfo, GenerateRequest, TokenDelta, decode

log = logging.getLogger("switchyard.gateway")

# The worker must start a request before its deadline; this margin covers its reply's trip back.
DEADLINE_GRACE_S = 2.0
# After this gateway's own reconnect, a stream whose live worker says nothing for this long lost its last deltas.
# Longer than a worker may legitimately go quiet through the same outage (its acks and records retry for seconds).
RECONNECT_SILENCE_S = 20.0
# An offer's fallback waits this long past the offer's own end, so a worker whose clock runs a little behind the
# gateway's has dropped its copy by the time the request goes to the shared queue.
OFFER_GRACE_S = 0.1


class RelayedRequest:
    """One published request: await ``first()``, then iterate the remaining deltas until the final one.

    It keeps what a continuation and a lost request's bill need (see gateway/failover.py): the worker running it,
    the prompt's token count, choice 0's token ids and text length so far, and every choice's token count.
    """

    def __init__(self, nc: NATS, request: GenerateRequest, inbox: DeltaInbox, stall_timeout_s: float,
                 retry_after_s: int,
                 liveness: WorkerLiveness | None = None, failover: Failover | None = None) -> None:
        self._nc = nc
        self._liveness = liveness
        self._failover = failover
        self.worker_id: str | None = None  # who runs it (None: not taken yet, or a continuation not taken yet)
        # Workers told to stop running it by name: one it was taken from (failover), or a second one that started
        # it too (JetStream redelivered it while the first was stalled). Their deltas are ignored.
        self._dismissed: set[str] = set()
        self._stale: set[tuple[str, int]] = set()  # (worker, attempt) runs told to stop, of attempts moved on from
        self.request = request
        self._inbox = inbox
        self._stall_timeout_s = stall_timeout_s
        self._retry_after_s = retry_after_s
        self._next_seq = 0
        self.is_finished = False
        self._prompt_tokens = 0
        self._num_tokens = 0  # every choice's, as streamed
        self._token_ids: list[int] = []  # choice 0's, as streamed
        self._text_len = 0  # choice 0's text streamed, in characters
        self._taken_at: float | None = None
        self._first_token_at: float | None = None
        self._reconnects_at_last_delta = liveness.num_reconnects if liveness is not None else 0
        self._fallback: tuple[float, Callable[[], Awaitable[object]]] | None = None  # see fall_back

    async def _next(self, timeout: float | None) -> TokenDelta:
        """The next delta to stream; raises TimeoutError when none came within ``timeout`` (None: by the token
        router's next idle tick)."""
        while True:
            data = await self._inbox.next(timeout)
            try:
                delta = decode(data, TokenDelta)
            except (msgspec.DecodeError, msgspec.ValidationError):
                log.error("request %s: an undecodable message on its token subject; ending it",
                          self.request.request_id)
                return await self._abandon(ErrorInfo("The worker sent a message that could not be read; please "
                                                     "retry.", code="bad_worker_message", type="server_error",
                                                     status=502))
            attempt = 0 if self.request.resume is None else self.request.resume.attempt
            if delta.attempt != attempt:  # a late delta of a run this request was taken from
                if delta.attempt < attempt and delta.worker_id is not None:
                    await self._dismiss_stale(delta.worker_id, delta.attempt)
                continue
            if self.worker_id is None or delta.worker_id in (None, self.worker_id):
                break
            if delta.worker_id not in self._dismissed:
                log.warning("request %s: worker %s runs it too (it runs on %s); telling it to stop",
                            self.request.request_id, delta.worker_id, self.worker_id)
                await self._dismiss(delta.worker_id)
        if delta.seq != self._next_seq:
            # A delta was lost on the way (a slow consumer's messages are dropped; a NATS node died and this
            # gateway reconnected to another): the text would have a hole. The request goes on from what the client
            # has, as after a worker's death (any live worker, this one too, takes the continuation); when it
            # cannot, it ends with an error rather than stream a text with a hole.
            log.warning("request %s: delta %d arrived where %d was due", self.request.request_id, delta.seq,
                        self._next_seq)
            if await self._continue_elsewhere(delta.worker_id, exclude_it=False):
                return await self._next(None if timeout is None else max(timeout, DEADLINE_GRACE_S))
            if self._failover is not None:
                await self._bill_lost()  # the dismissed worker bills nothing: the streamed tokens are billed here
            return await self._abandon(ErrorInfo(
                f"Part of the response was lost in transit (message {self._next_seq} of the stream never "
                "arrived); please retry.", code="stream_gap", type="server_error", status=502))
        self._next_seq += 1
        self._account(delta)
        if delta.finish_reason == HANDOVER and delta.error is None:
            return await self._hand_over(delta)
        if delta.is_last or delta.error is not None:  # the engine counts a request's choices, nobody else
            self.is_finished = True
            if delta.error is not None and self._dismissed:
                await self._bill_lost()  # the continuation failed: what was streamed is billed all the same
        return delta

    async def _hand_over(self, delta: TokenDelta) -> TokenDelta:
        """A prefill worker's part ended with the first token: the request goes on on a decode worker, loading the
        prompt's KV blocks the prefill left in the shared tier, and the client gets the token's text, no end."""
        continuation = None
        if self._failover is not None:
            continuation = await self._failover.hand_over(self.request, self._token_ids, self._text_len,
                                                          self.worker_id, delta.kv_transfer)
        if continuation is None:  # not queued (queue full, NATS away): what ran is billed, the client told
            await self._bill_lost()
            return await self._abandon(ErrorInfo("The request could not go on after its prefill; please retry.",
                                                 code="worker_lost", type="server_error", status=503))
        self.request, self.worker_id, self._next_seq = continuation, None, 0
        return msgspec.structs.replace(delta, finish_reason=None, is_last=False, usage=None)

    def _account(self, delta: TokenDelta) -> None:
        if self._liveness is not None:
            self._reconnects_at_last_delta = self._liveness.num_reconnects
        if self.worker_id is None:
            self.worker_id = delta.worker_id
            self._taken_at = self._taken_at or time.time()
        self._prompt_tokens = delta.prompt_tokens or self._prompt_tokens
        self._num_tokens += delta.num_tokens
        if delta.num_tokens and self._first_token_at is None:
            self._first_token_at = time.time()
        if delta.index == 0:
            self._token_ids += delta.token_ids or ()
            self._text_len += len(delta.text)

    async def _abandon(self, error: ErrorInfo) -> TokenDelta:
        """Give up on the request: the worker is told to stop, and the client gets ``error`` as the last delta."""
        await self.cancel()
        self.is_finished = True
        return TokenDelta(self.request.request_id, error=error)

    def fall_back(self, at: float, publish: Callable[[], Awaitable[object]]) -> None:
        """The request was offered to one worker: unless a first message comes by unix time ``at``, ``publish()``
        puts it in the shared queue (see Relay.submit)."""
        self._fallback = (at, publish)

    async def first(self) -> TokenDelta:
        """The worker's first message; raises OpenAIError (503) if no worker takes it before the deadline."""
        if self._fallback is not None:
            at, publish = self._fallback
            self._fallback = None
            try:
                return self._checked(await self._next(max(0.01, at - time.time())))
            except (TimeoutError, NatsTimeoutError):
                await publish()  # the preferred worker did not take it soon: any worker may
        timeout = max(0.1, self.request.deadline_at + DEADLINE_GRACE_S - time.time())
        try:
            delta = await self._next(timeout)
        except (TimeoutError, NatsTimeoutError):
            await self.cancel()
            raise service_unavailable(
                "No worker took the request before its queue deadline; please retry.",
                self._retry_after_s,
                code="queue_timeout",
            ) from None
        return self._checked(delta)

    @property
    def next_delta_waits(self) -> bool:
        """Whether the next delta is still to come: none has arrived untaken and the request has not finished.
        A stream writes what it holds then, and otherwise holds it to write with what is already here."""
        return not self.is_finished and self._inbox.pending == 0

    def _checked(self, delta: TokenDelta) -> TokenDelta:
        if delta.error is not None:
            raise OpenAIError.from_info(delta.error, self._error_headers(delta.error.status))
        return delta

    def _error_headers(self, status: int) -> dict[str, str]:
        return {"Retry-After": str(self._retry_after_s)} if status in (429, 503) else {}

    async def deltas(self) -> AsyncIterator[TokenDelta]:
        """Deltas after the first, ending with the final one(s). A dead worker's request goes on on another
        worker when it can (gateway/failover.py), else ends with an error delta within seconds; a silent one
        ends with an error after ``stall_timeout_s``."""
        heard_at = time.monotonic()
        while not self.is_finished:
            try:
                # Woken at least every idle tick (a second), so a dead worker is noticed without a message from it.
                delta = await self._next(None)
                heard_at = time.monotonic()
            except (TimeoutError, NatsTimeoutError):
                error = self._silence_error(time.monotonic() - heard_at)
                if error is None:
                    continue
                if error.code == "worker_lost":
                    if self.worker_id is not None and await self._continue_elsewhere(self.worker_id):
                        heard_at = time.monotonic()
                        continue
                    await self._bill_lost()
                elif error.code == "stream_gap":
                    if await self._continue_elsewhere(self.worker_id, exclude_it=False):
                        heard_at = time.monotonic()
                        continue
                    await self._bill_lost()  # the dismissed worker bills nothing: the streamed tokens are billed here
                delta = await self._abandon(error)
            yield delta

    def _silence_error(self, silent_s: float) -> ErrorInfo | None:
        """Why a request whose worker has said nothing for ``silent_s`` is given up on, or None to wait on."""
        lost = ErrorInfo("The worker running the request stopped; please retry.", code="worker_lost",
                         type="server_error", status=503)
        if self.worker_id is None:  # a continuation no worker has taken yet
            return lost if time.time() > self.request.deadline_at + DEADLINE_GRACE_S else None
        if self._liveness is not None and self._liveness.is_dead(self.worker_id):
            return lost
        if (self._liveness is not None and self._liveness.num_reconnects != self._reconnects_at_last_delta
                and silent_s > RECONNECT_SILENCE_S):
            # This gateway lost its NATS connection since the last delta and the worker, alive, says nothing: what
            # it sent meanwhile (its last deltas, perhaps the final one) was lost, and no later delta will show a gap.
            return ErrorInfo("Part of the response was lost in transit; please retry.", code="stream_gap",
                             type="server_error", status=502)
        if silent_s > self._stall_timeout_s:
            return ErrorInfo("The worker stopped answering; the request was abandoned.", code="worker_timeout",
                             type="server_error", status=503)
        return None

    async def _continue_elsewhere(self, worker_id: str | None, exclude_it: bool = True) -> bool:
        """Dismiss ``worker_id`` and have the request go on from what the client has on another worker (or any,
        this one included, unless ``exclude_it``); whether a continuation was published."""
        if worker_id is not None:
            await self._dismiss(worker_id)  # taken for dead, or its stream has a hole: it must not run on
        if self._failover is None:
            return False
        continuation = await self._failover.continue_elsewhere(
            self.request, worker_id if exclude_it else None, self._token_ids, self._text_len)
        if continuation is None:
            return False
        self.request, self.worker_id, self._next_seq = continuation, None, 0
        return True

    async def _dismiss(self, worker_id: str) -> None:
        """Tell one worker, by name, to stop running this request and bill none of it (see Intake.on_cancel)."""
        self._dismissed.add(worker_id)
        await self._cancel_on(worker_id)

    async def _dismiss_stale(self, worker_id: str, attempt: int) -> None:
        """Tell one worker to stop its run of an earlier ``attempt`` of this request, unbilled (a prefill offer's
        fallback copy that started after the prefill did): its later attempt, if it runs one, goes on."""
        if (worker_id, attempt) not in self._stale:
            self._stale.add((worker_id, attempt))
            await self._cancel_on(worker_id, attempt)

    async def _cancel_on(self, worker_id: str, attempt: int | None = None) -> None:
        """A cancel addressed to one worker (``<worker id>[:<attempt>]``, see Intake.on_cancel)."""
        if self._nc.is_connected:
            target = worker_id if attempt is None else f"{worker_id}:{attempt}"
            await self._nc.publish(subjects.cancel_subject(self.request.request_id), target.encode())

    async def _bill_lost(self) -> None:
        if self._failover is not None:
            await self._failover.bill_lost(self.request, self.worker_id or next(iter(self._dismissed), None),
                                           self._prompt_tokens, self._num_tokens, self._taken_at,
                                           self._first_token_at)

    @property
    def buffered_bytes(self) -> int:
        """Deltas received and not yet read, in bytes (a stream's reader falling behind: gateway/client_watch.py)."""
        return self._inbox.pending_bytes

    async def cancel(self) -> None:
        """Tell the worker to stop (client went away, or we gave up); safe to call more than once."""
        if self._nc.is_connected:
            await self._nc.publish(subjects.cancel_subject(self.request.request_id), b"")

    async def close(self) -> None:
        try:
            await self._inbox.close()
        except Exception:  # the connection may already be closing; nothing left to release then
            pass


class Relay:
    """Submits requests; one per gateway process, shared by all handlers."""

    def __init__(self, nc: NATS, router: TokenRouter, publisher: RequestPublisher, stall_timeout_s: float,
                 retry_after_s: int, liveness: WorkerLiveness | None = None, failover: Failover | None = None) -> None:
        """``router``: this process's token subject, started (its deltas come there)."""
        self._nc = nc
        self._router = router
        self._publisher = publisher
        self._liveness = liveness
        self._failover = failover
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
        inbox = self._router.open(request.request_id)
        relayed = RelayedRequest(self._nc, request, inbox, self._stall_timeout_s, self._retry_after_s,
                                 self._liveness, self._failover)
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

    async def _publish(self, request: GenerateRequest, payload: bytes | None = None, **where) -> None:
        try:
            await self._publisher.publish(request, payload, **where)
        except QueueFull:
            await self._publisher.count_refusal(request)  # a 429 the client gets
            raise
