"""One request published and relayed: its deltas read from this gateway's token subject in order, and what the
relay's state machine (gateway/relay_state.py) decides done: dismissals, continuations on another worker
(gateway/failover.py), hedges (gateway/hedging.py), a silent worker given up on. gateway/relay.py publishes it."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
from nats.aio.client import Client as NATS
from nats.errors import TimeoutError as NatsTimeoutError

from switchyard.domain.errors import OpenAIError, service_unavailable
from switchyard.gateway.failover import Failover
from switchyard.gateway.hedging import Hedging
from switchyard.gateway.liveness import WorkerLiveness
from switchyard.gateway.relay_state import RelayState
from switchyard.gateway.token_router import IDLE_TICK_S, DeltaInbox
from switchyard.shared import subjects
from switchyard.shared.messages import (
    HANDOVER,
    ErrorInfo,
    GenerateRequest,
    TokenDelta,
    Usage,
    decode,
)

log = logging.getLogger("switchyard.gateway")

# The worker must start a request before its deadline; this margin covers its reply's trip back.
DEADLINE_GRACE_S = 2.0
# After this gateway's own reconnect, a stream whose live worker says nothing for this long lost its last deltas.
# Longer than a worker may legitimately go quiet through the same outage (its acks and records retry for seconds).
RECONNECT_SILENCE_S = 20.0


class RelayedRequest:
    """One published request: await ``first()``, then iterate the remaining deltas until the final one.

    Which worker runs it and which deltas the client gets is its state machine's (gateway/relay_state.py); this
    carries out what that decides (dismissals, continuations, hedges) and keeps what a continuation and a lost
    request's bill need (see gateway/failover.py): the prompt's token count, choice 0's token ids and text length
    so far, and every choice's token count.
    """

    def __init__(self, nc: NATS, request: GenerateRequest, inbox: DeltaInbox, stall_timeout_s: float,
                 retry_after_s: int,
                 liveness: WorkerLiveness | None = None, failover: Failover | None = None,
                 hedging: Hedging | None = None, hedge_at: float | None = None) -> None:
        """``hedge_at``: unix time at which, with no token yet, ``hedging`` offers it to a second worker."""
        self._nc = nc
        self._liveness = liveness
        self._failover = failover
        self._hedging = hedging
        self._hedge_at = hedge_at if hedging is not None else None
        self.request = request
        self.state = RelayState(request.attempt)
        self._ran_on: str | None = None  # the last worker the client was on (a lost request's bill names it)
        self._inbox = inbox
        self._stall_timeout_s = stall_timeout_s
        self._retry_after_s = retry_after_s
        self._prompt_tokens = 0
        # What the client has had of choice 0 (a stream taken over starts from what earlier runs streamed).
        resumed = request.resume
        self._num_tokens = len(resumed.token_ids) if resumed is not None else 0  # every choice's, as streamed
        self._token_ids: list[int] = list(resumed.token_ids) if resumed is not None else []  # choice 0's
        self._text_len = resumed.text_len if resumed is not None else 0  # choice 0's text, in characters
        self._taken_at: float | None = None
        self._first_token_at: float | None = None
        self._reconnects_at_last_delta = liveness.num_reconnects if liveness is not None else 0
        self._fallback: tuple[float, Callable[[], Awaitable[object]]] | None = None  # see fall_back
        self._failed_over = False  # went on elsewhere after a failure: an error then still bills what streamed

    def had_before(self, token_ids: list[int], text_len: int) -> None:
        """The client had these of choice 0 before the first delta this gateway relays (a stream taken over)."""
        self._token_ids += token_ids
        self._num_tokens += len(token_ids)
        self._text_len += text_len

    @property
    def text_len(self) -> int:
        """Choice 0's text the client has had, in characters."""
        return self._text_len

    @property
    def worker_id(self) -> str | None:
        """The worker the client is on (None: not taken yet, or a continuation not taken yet)."""
        return self.state.worker_id

    @property
    def is_finished(self) -> bool:
        return self.state.is_finished

    @property
    def handed_off(self) -> bool:
        """Another gateway took the stream over (its client resumed there; the last delta was its worker's notice):
        it goes on there, which ends it, stores it and has its worker bill it; this gateway's part ends quietly."""
        return self.state.handed_off

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
            verdict = self.state.on_delta(delta)
            if verdict.stale is not None:
                await self._cancel_on(*verdict.stale)
            for worker in verdict.dismiss:
                log.warning("request %s: telling worker %s to stop: %s", self.request.request_id, worker, verdict.why)
                await self._cancel_on(worker)
            if verdict.hedge_won is not None and self._hedging is not None:
                self._hedging.decided(self.request, verdict.hedge_won)
            if verdict.broken:
                # A delta was lost on the way (a slow consumer's messages are dropped; a NATS node died and this
                # gateway reconnected to another): the text would have a hole. The request goes on from what the
                # client has, as after a worker's death (any live worker, this one too, takes the continuation);
                # when it cannot, it ends with an error rather than stream a text with a hole.
                log.warning("request %s: delta %d of worker %s arrived out of order (expected %s; attempt %d, "
                            "%d tokens streamed, last=%s, error=%s)", self.request.request_id, delta.seq,
                            delta.worker_id, verdict.expected_seq, delta.attempt, self._num_tokens, delta.is_last,
                            None if delta.error is None else delta.error.code)
                if await self._continue_elsewhere(None):
                    return await self._next(None if timeout is None else max(timeout, DEADLINE_GRACE_S))
                # The dismissed worker bills nothing: the streamed tokens are billed here.
                billed = await self._bill_lost()
                return await self._abandon(ErrorInfo(
                    "Part of the response was lost in transit (a message of the stream never arrived); please "
                    "retry.", code="stream_gap", type="server_error", status=502), billed)
            if verdict.deliver:
                break
        self._account(delta)
        if delta.finish_reason == HANDOVER and delta.error is None:
            return await self._hand_over(delta)
        if (self.is_finished and delta.error is not None and self._failed_over
                and not self.handed_off):  # taken over, it goes on and its worker bills it
            billed = await self._bill_lost()  # the continuation failed: what was streamed is billed all the same
            error = delta.error
            if error.status < 500 or error.code == "queue_timeout":
                # The continuation was refused, not the client's request (a worker that cannot resume this kind of
                # request, or one that took it past its deadline): the client hears that its worker was lost.
                error = ErrorInfo(f"The worker running the request stopped, and the request could not go on on "
                                  f"another: {error.message}", code="worker_lost", type="server_error", status=503)
            return msgspec.structs.replace(delta, error=error, usage=billed)
        return delta

    async def _hand_over(self, delta: TokenDelta) -> TokenDelta:
        """A prefill worker's part ended with the first token: the request goes on on a decode worker, loading the
        prompt's KV blocks the prefill left in the shared tier, and the client gets the token's text, no end."""
        continuation = None
        if self._failover is not None:
            continuation = await self._failover.hand_over(self.request, self._token_ids, self._text_len,
                                                          self.worker_id, delta.kv_transfer)
        if continuation is None:  # not queued (queue full, NATS away): what ran is billed, the client told
            billed = await self._bill_lost()
            return await self._abandon(ErrorInfo("The request could not go on after its prefill; please retry.",
                                                 code="worker_lost", type="server_error", status=503), billed)
        self._go_on_as(continuation)
        return msgspec.structs.replace(delta, finish_reason=None, is_last=False, usage=None)

    def _go_on_as(self, continuation: GenerateRequest) -> None:
        assert continuation.resume is not None  # a continuation says where it resumes
        self.request = continuation
        self.state.continued(continuation.resume.attempt)

    def _account(self, delta: TokenDelta) -> None:
        if self._liveness is not None:
            self._reconnects_at_last_delta = self._liveness.num_reconnects
        self._ran_on = self.state.worker_id or self._ran_on
        self._taken_at = self._taken_at or time.time()
        self._prompt_tokens = delta.prompt_tokens or self._prompt_tokens
        self._num_tokens += delta.num_tokens
        if delta.num_tokens and self._first_token_at is None:
            self._first_token_at = time.time()
            if self._hedging is not None:
                self._hedging.first_token(self.request, self._first_token_at - self.request.created_at)
        if delta.index == 0:
            self._token_ids += delta.token_ids or ()
            self._text_len += len(delta.text)

    async def _abandon(self, error: ErrorInfo, billed: Usage | None = None) -> TokenDelta:
        """Give up on the request: the worker is told to stop, and the client gets ``error`` as the last delta
        (with ``billed``, what this gateway billed for it, as a worker's error delta carries what it ran)."""
        await self.cancel()
        self.state.finish()
        return TokenDelta(self.request.request_id, error=error, usage=billed)

    def fall_back(self, at: float, publish: Callable[[], Awaitable[object]]) -> None:
        """The request was offered to one worker: unless a first message comes by unix time ``at``, ``publish()``
        puts it in the shared queue (see Relay.submit)."""
        self._fallback = (at, publish)

    async def first(self, timeout_s: float | None = None) -> TokenDelta:
        """The worker's first message; raises OpenAIError (503) if no worker takes it before the deadline (or
        within ``timeout_s``, when given)."""
        if self._fallback is not None:
            at, publish = self._fallback
            self._fallback = None
            try:
                return self._checked(await self._next(max(0.01, at - time.time())))
            except (TimeoutError, NatsTimeoutError):
                await publish()  # the preferred worker did not take it soon: any worker may
        timeout = timeout_s or max(0.1, self.request.deadline_at + DEADLINE_GRACE_S - time.time())
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
        """Deltas after the first, ending with the final one(s). A request with no token by its hedge time is
        offered to a second worker too (gateway/hedging.py); a dead worker's request goes on on the next worker to take
        it (gateway/failover.py), else ends with an error delta at its queue deadline; a silent one ends with an error
        after ``stall_timeout_s``."""
        heard_at = time.monotonic()
        while not self.is_finished:
            try:
                # Woken at least every idle tick (a second), so a dead worker is noticed without a message from it.
                delta = await self._next(self._hedge_wait())
                heard_at = time.monotonic()
            except (TimeoutError, NatsTimeoutError):
                await self._hedge_if_due()
                for worker in self.state.drop_gone(self._is_dead, time.time()):
                    log.warning("request %s: hedged worker %s is gone; it goes on on %s", self.request.request_id,
                                worker, self.worker_id)
                    await self._cancel_on(worker)
                error = self._silence_error(time.monotonic() - heard_at)
                if error is None:
                    continue
                billed = None
                if error.code == "worker_lost":
                    if self.worker_id is not None and await self._continue_elsewhere(self.worker_id):
                        heard_at = time.monotonic()
                        continue
                    billed = await self._bill_lost()
                elif error.code == "stream_gap":
                    if await self._continue_elsewhere(None):
                        heard_at = time.monotonic()
                        continue
                    billed = await self._bill_lost()  # the dismissed worker bills nothing: billed here
                delta = await self._abandon(error, billed)
            yield delta

    def _hedge_wait(self) -> float | None:
        """How long to wait for a delta before hedging (None: no hedge is due, wait for the idle tick)."""
        if self._hedge_at is None or not self.state.may_hedge:
            return None
        return min(IDLE_TICK_S, max(0.001, self._hedge_at - time.time()))

    async def _hedge_if_due(self) -> None:
        if self._hedge_at is None or not self.state.may_hedge or time.time() < self._hedge_at:
            return
        assert self._hedging is not None  # hedge_at is set only with it
        self._hedge_at = None  # one hedge per request: a second would only add load
        placed = await self._hedging.offer(self.request, list(self.state.runs))
        if placed is not None:
            self.state.hedged(*placed)

    def _is_dead(self, worker_id: str) -> bool:
        return self._liveness is not None and self._liveness.is_dead(worker_id)

    def _silence_error(self, silent_s: float) -> ErrorInfo | None:
        """Why a request whose worker has said nothing for ``silent_s`` is given up on, or None to wait on."""
        lost = ErrorInfo("The worker running the request stopped; please retry.", code="worker_lost",
                         type="server_error", status=503)
        if self.worker_id is None:  # a continuation no worker has taken yet
            return lost if time.time() > self.request.deadline_at + DEADLINE_GRACE_S else None
        if self._is_dead(self.worker_id) or self.state.offer_unused(time.time()):
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

    async def _continue_elsewhere(self, dead_worker: str | None) -> bool:
        """Dismiss every run (taken for dead, or a stream with a hole: none may run on) and have the request go on
        from what the client has on the next worker to pull it (``dead_worker``: the one taken for dead, None: a
        broken stream's); whether a continuation was published."""
        # With the attempt: the continuation shares the request id, and a worker back from a stall may take it
        # before it reads this cancel; only the run dismissed here stops.
        attempt = self.state.attempt
        for worker in self.state.lost():
            await self._cancel_on(worker, attempt)
        if self._failover is None:
            return False
        continuation = await self._failover.continue_elsewhere(self.request, dead_worker, self._token_ids,
                                                               self._text_len)
        if continuation is None:
            return False
        self._go_on_as(continuation)
        self._failed_over = True
        return True

    async def _cancel_on(self, worker_id: str, attempt: int | None = None) -> None:
        """A cancel addressed to one worker (``<worker id>[:<attempt>]``, see Intake.on_cancel): it stops running
        this request (that attempt's run of it) and bills none of it."""
        if self._nc.is_connected:
            target = worker_id if attempt is None else f"{worker_id}:{attempt}"
            await self._nc.publish(subjects.cancel_subject(self.request.request_id), target.encode())

    async def _bill_lost(self) -> Usage:
        """Bill what was streamed of a request whose worker will not (dismissed or dead); returns that usage."""
        if self._failover is not None:
            await self._failover.bill_lost(self.request, self.worker_id or self._ran_on, self._prompt_tokens,
                                           self._num_tokens, self._taken_at, self._first_token_at)
        return Usage(self._prompt_tokens, self._num_tokens)

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
