"""What a worker sends out: token deltas (core NATS), usage records and batch results (JetStream, durable).

    started(tracked)   the first, empty delta ("taken", with the prompt's tokens) and a batch line's "started"
    relay(tracked, d)  each step's delta of a request (a batch line's text is gathered for its result)
    finished(tracked)  after the request's last delta: its usage record, then a batch line's whole result
    error(request, e)  instead of any of these, or of the rest: the request ends with ``e``
    take_over(ask)     another gateway takes a resumable stream over: its kept deltas again, then the rest there

A step's deltas go out together (``StepDeltas``, then ``send``): one message per gateway, holding the deltas of
every request that gateway relays (``GenerateRequest.reply_subject``). A message per delta would cost the worker,
NATS and the gateway each a round of per-message work per token (at 1,000 streams of 20 tokens/s, 20,000 messages a
second); this way it is one per step and gateway (bench/streams.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import msgspec

from switchyard.shared import subjects
from switchyard.shared.jetstream import HEADER_ROOM, publish_once
from switchyard.shared.messages import (
    HANDOVER,
    TAKEN_OVER,
    BatchResult,
    ErrorInfo,
    GenerateRequest,
    RoutedDelta,
    StreamResume,
    TokenDelta,
    Usage,
    UsageRecord,
    encode,
)
from switchyard.workers.service.held import Tracked
from switchyard.workers.service.stream_replay import StreamReplays

log = logging.getLogger("switchyard.worker")


_routed_encoder = msgspec.msgpack.Encoder()  # a message of ``RoutedDelta``s (``encode`` takes one struct)

# How long a usage record or batch result is retried through a NATS outage (a cluster electing a leader takes
# seconds, a restarted server about as long) before it is logged as lost. Deltas wait behind it meanwhile.
RECORD_RETRY_S = 30.0


class StepDeltas:
    """A step's deltas, in the order they were added; numbered, encoded and routed only when sent."""

    __slots__ = ("items",)

    def __init__(self) -> None:
        self.items: list[tuple[GenerateRequest, TokenDelta]] = []

    def add(self, request: GenerateRequest, delta: TokenDelta) -> None:
        self.items.append((request, delta))


def messages_of(deltas: list[RoutedDelta], max_bytes: int) -> list[bytes]:
    """``deltas`` encoded as few messages as hold them, each at most ``max_bytes`` unless one delta alone is more
    (an embeddings delta is sized to fit a message by itself: it then goes alone)."""
    out: list[bytes] = []
    start, size = 0, 0
    for i, routed in enumerate(deltas):
        item = len(routed.delta) + len(routed.request_id) + 16  # its framing: the pair's and the strings' headers
        if size + item > max_bytes and i > start:
            out.append(_routed_encoder.encode(deltas[start:i]))
            start, size = i, 0
        size += item
    if start < len(deltas):
        out.append(_routed_encoder.encode(deltas[start:] if start else deltas))
    return out


class Publisher:
    """Publishes one worker's outputs; every method is safe to call whatever NATS is doing (errors are logged
    where a retry happens elsewhere)."""

    def __init__(self, nc, js, worker_id: str, replays: StreamReplays | None = None) -> None:
        """``replays``: where a resumable request's deltas are kept, and where they go after another gateway took
        its stream over (workers/service/stream_replay.py)."""
        self._nc = nc
        self._js = js
        self.worker_id = worker_id
        self._replays = replays
        self._next_seq: dict[str, int] = {}  # per request still publishing: the seq its next delta gets
        # A stream taken over is sent its kept deltas while no step's go out, so that none comes before them.
        self._sending = asyncio.Lock()

    async def delta(self, request: GenerateRequest, delta: TokenDelta, step: StepDeltas | None = None) -> None:
        """Add ``delta`` to ``step`` (sent with the step's others by ``send``), or send it now, alone."""
        if step is not None:
            step.add(request, delta)
            return
        alone = StepDeltas()  # outside a step (a refusal from the intake): at once
        alone.add(request, delta)
        await self.send(alone)

    async def send(self, step: StepDeltas) -> None:
        """Every delta added to ``step``, numbered now: a message per gateway (more where one would pass NATS's
        max_payload). A delta gets its number as it goes out, under the one lock every send takes, so that a
        request's deltas leave in their numbers' order whichever task sends them (a delta numbered when made and
        sent at the end of its step would be passed by one sent alone meanwhile, and its gateway would see a
        hole)."""
        async with self._sending:
            await self._send(self._routed(step))

    def _routed(self, step: StepDeltas) -> dict[str | None, list[RoutedDelta]]:
        """``step``'s deltas numbered, encoded and kept for a resume, by where they go (None: each request's own
        subject). Called with the send lock held: a take-over moves a route only between sends."""
        by_route: dict[str | None, list[RoutedDelta]] = {}
        for request, delta in step.items:
            request_id = delta.request_id
            delta.seq = self._next_seq.get(request_id, 0)
            delta.worker_id = self.worker_id
            if delta.is_last:  # the run's last: a later run of it (a copy JetStream delivers again) starts over
                self._next_seq.pop(request_id, None)
            else:
                self._next_seq[request_id] = delta.seq + 1
            data = encode(delta)
            route = request.reply_subject
            if self._replays is not None:
                self._replays.record(request, delta, data)
                route = self._replays.route(request)
            by_route.setdefault(route, []).append(RoutedDelta(request_id, msgspec.Raw(data)))
        step.items.clear()
        return by_route

    async def _send(self, by_route: dict[str | None, list[RoutedDelta]]) -> None:
        max_bytes = self._nc.max_payload - HEADER_ROOM
        for route, deltas in by_route.items():
            if route is None:  # wire clients, each subscribed to its request's own subject: one delta a message
                for routed in deltas:
                    await self._nc.publish(subjects.token_subject(routed.request_id), bytes(routed.delta))
                continue
            for data in messages_of(deltas, max_bytes):
                await self._nc.publish(route, data)

    def drop_stream(self, request: GenerateRequest) -> None:
        """This run of ``request`` no longer answers for its stream (superseded, or handed over): another does."""
        if self._replays is not None:
            self._replays.drop(request.request_id, request.attempt)

    async def take_over(self, ask: StreamResume, respond: Callable[[bytes], Awaitable[object]]) -> None:
        """Another gateway asks for a stream (gateway/stream_resume.py). While no step's deltas go out, its route
        moves there, ``respond`` gets the answer, and the deltas kept of it follow, before any later one."""
        assert self._replays is not None  # asked only of a worker that keeps them
        async with self._sending:
            before = self._replays.route_of(ask.request_id)
            taken = self._replays.resume(ask)
            if taken is None:
                return  # not ours, or not the asker's: no answer, as for an unknown request
            answer, deltas = taken
            await respond(encode(answer))
            if answer.request is not None and before is not None and before != ask.reply_subject:
                # The gateway that relayed it so far may live (its client's connection hung, and the client came
                # back elsewhere): it is told, out of the run's numbering, so that it ends its part quietly.
                notice = TokenDelta(ask.request_id, error=TAKEN_OVER, is_last=True, attempt=answer.request.attempt,
                                    worker_id=self.worker_id, seq=answer.next_seq)
                await self._send({before: [RoutedDelta(ask.request_id, msgspec.Raw(encode(notice)))]})
            await self._send({ask.reply_subject: [RoutedDelta(ask.request_id, msgspec.Raw(data)) for data in deltas]})

    async def started(self, tracked: Tracked, step: StepDeltas | None = None) -> None:
        """``tracked`` is in the engine: its first delta, and a batch line's hint for the batch runner."""
        req = tracked.request
        await self.delta(req, TokenDelta(req.request_id, dropped_messages=tracked.dropped_messages,
                                         prompt_tokens=tracked.prompt_tokens, attempt=req.attempt), step)
        if req.result_subject:
            await self.batch_result(req, BatchResult(req.request_id, self.worker_id, started=True))

    async def relay(self, tracked: Tracked, delta: TokenDelta, step: StepDeltas | None = None) -> None:
        """One of the engine's deltas of ``tracked``."""
        delta.attempt = tracked.request.attempt
        await self.delta(tracked.request, delta, step)
        if tracked.request.result_subject:
            tracked.collect(delta)

    async def error(self, request: GenerateRequest, error: ErrorInfo, step: StepDeltas | None = None) -> None:
        """Answer ``request`` with ``error`` instead of running (or finishing) it."""
        await self.delta(request, TokenDelta(request.request_id, error=error, attempt=request.attempt,
                                             is_last=True), step)
        if self._replays is not None:
            self._replays.finished(request.request_id, time.monotonic())
        if request.result_subject:
            await self.batch_result(request, BatchResult(request.request_id, self.worker_id, error=error))

    async def batch_result(self, request: GenerateRequest, result: BatchResult) -> None:
        """A batch line's result (or its ``started`` hint) on the subject its request names."""
        subject = request.result_subject
        assert subject is not None  # called only for a batch line's request, which names where its results go
        try:
            if result.started:  # a hint for the batch runner, sent once per run: no retries, no dedup
                await self._js.publish(subject, encode(result))
            else:  # durable, and deduplicated by request id: a final result published twice is stored once
                await publish_once(self._js, subject, encode(result), request.request_id,
                                   within_s=RECORD_RETRY_S)
        except Exception:  # the batch runner re-publishes a line whose result never comes
            log.exception("could not publish the batch result of %s", request.request_id)

    async def finished(self, tracked: Tracked, finish_reason: str, now: float) -> None:
        """The usage record of a request whose every choice has ended, then (a batch line) its whole result.
        A superseded request gets neither, nor does a prefill worker's part of one (``HANDOVER``): the worker that
        continued it bills every token and answers."""
        req = tracked.request
        if tracked.superseded or finish_reason == HANDOVER:
            self.drop_stream(req)
            return
        if self._replays is not None:
            self._replays.finished(req.request_id, time.monotonic(), cancelled=finish_reason == "cancelled")
        record = UsageRecord(
            request_id=req.request_id,
            model=req.model,
            tier=req.tier,
            prompt_tokens=tracked.prompt_tokens,
            completion_tokens=tracked.completion_tokens,
            cached_tokens=tracked.cached_tokens,
            finish_reason=finish_reason,
            created_at=req.created_at,
            queue_ms=(tracked.admitted_at - req.created_at) * 1000,
            first_token_ms=None if tracked.first_token_at is None else (tracked.first_token_at - req.created_at) * 1000,
            total_ms=(now - req.created_at) * 1000,
            tenant_id=req.tenant_id,
            api_key_id=req.api_key_id,
            worker_id=self.worker_id,
            end_user=req.end_user,
            metadata=req.metadata,
            prefill_worker_id=req.resume.prefill_worker if req.resume is not None else None,
            kv_loaded_bytes=tracked.kv_loaded_bytes,
        )
        try:
            await publish_once(self._js, subjects.USAGE_SUBJECT, encode(record), req.request_id,
                               within_s=RECORD_RETRY_S)
        except Exception:
            log.exception("could not record usage of %s", req.request_id)
        if req.result_subject:  # after the usage record: a line is never done but unbilled
            usage = Usage(tracked.prompt_tokens, tracked.completion_tokens, tracked.cached_tokens)
            choices = [tracked.choices[i] for i in sorted(tracked.choices)]
            await self.batch_result(req, BatchResult(req.request_id, self.worker_id, choices=choices, usage=usage))

