"""A worker's step loop: the engine's steps back to back on the step thread, each one's outcome published while
the next one runs, and the drain.

    event loop                                         step thread (the only one that touches the engine)
    ──────────                                         ──────────────────────────────────────────────────
    held.hand_over() ─ adds, aborts ─────────────────▶ add_request / abort_request ─▶ Admission
    batch limit, pausing quanta (when changed) ───────▶ step() ─▶ capacity, stats
    publish step N-1 (deltas, usage)        ◀─ overlap ─┤
    publish the admission (acks, first messages) ◀──────┤
    capacity.update(step N's) ◀────────────────────────┘ StepResult
    seats freed? let the intake refill them (≤ 20 ms) before step N+1

A request's first message goes out before the step that starts it runs, not after: a gateway waiting on an offer
(a prefill worker's, a worker holding the prefix) learns at once that it was taken, rather than a step later (a
long prompt's step lasts seconds on a CPU), and does not give it to another worker meanwhile. The publishing of
one step always ends before the next step's starts, so a request's deltas stay in order. On
``stop`` the loop drains: the intake stops pulling, running requests get ``drain_timeout_s`` to finish, and what
is left then ends with ``worker_shutdown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from nats.aio.msg import Msg

from switchyard.shared.messages import ErrorInfo, TokenDelta
from switchyard.workers.service.capacity import Capacity
from switchyard.workers.service.held import HeldRequests, Tracked
from switchyard.workers.service.intake import CANCELLED, Intake, offer_expired
from switchyard.workers.service.kv_events import KVEventPublisher
from switchyard.workers.service.metrics import WorkerMetrics
from switchyard.workers.service.publisher import Publisher, StepDeltas
from switchyard.workers.service.request_trace import record_request_trace
from switchyard.workers.service.waiting import first_of
from switchyard.workers.serving.interface import EngineCapacity, EngineStats, RequestRejected, ServingEngine
from switchyard.workers.serving.kv_changes import KVChanges

log = logging.getLogger("switchyard.worker")

REFILL_WAIT_S = 0.02  # how long a step waits for the intake to refill freed seats


@dataclass(slots=True)
class Admission:
    """What adding requests to the engine, before a step, hands back to the event loop."""

    admitted: list[tuple[Tracked, Msg]] = field(default_factory=list)  # (tracked, its JetStream message)
    rejected: list[tuple[Tracked, Msg, ErrorInfo]] = field(default_factory=list)
    dropped: list[tuple[Tracked, Msg]] = field(default_factory=list)  # offers past their time: acked, no answer


@dataclass(slots=True)
class StepResult:
    """What one step on the step thread hands back to the event loop."""

    deltas: list[TokenDelta] = field(default_factory=list)
    capacity: EngineCapacity | None = None  # the engine after the step: what may be pulled now
    has_unfinished: bool = False  # whether the engine has more to do without new work
    stats: EngineStats | None = None  # the engine after the step, for the metrics
    safety_events: list = field(default_factory=list)  # the output filter's verdicts (interface.SafetyEvent)
    kv_changes: KVChanges | None = None  # what the KV cache gained and lost: the worker's KV events


class StepLoop:
    """See the module docstring; ``num_steps``, ``step_s`` and ``gap_s`` go into the worker's heartbeat."""

    def __init__(self, engine: ServingEngine[Any], step_thread: ThreadPoolExecutor, held: HeldRequests,
                 capacity: Capacity, intake: Intake, out: Publisher, metrics: WorkerMetrics,
                 drain_timeout_s: float, kv_events: KVEventPublisher | None = None) -> None:
        """``kv_events``: where each step's KV changes go (None: not published)."""
        self._engine = engine
        self._step_thread = step_thread
        self._held = held
        self._capacity = capacity
        self._intake = intake
        self._out = out
        self._metrics = metrics
        self._drain_timeout_s = drain_timeout_s
        self._kv_events = kv_events
        self._engine_busy = False  # the engine has requests or finals, as of the last step
        self.num_steps, self.step_s, self.gap_s = 0, 0.0, 0.0  # see WorkerInfo

    async def run(self, stop: asyncio.Event) -> None:
        """Steps back to back while there is work, until ``stop`` is set and everything held has ended."""
        publishing: asyncio.Task | None = None
        ended_at: float | None = None  # when the previous step ended, if the loop went straight on
        drain_deadline: float | None = None
        held = self._held
        while True:
            if stop.is_set() and drain_deadline is None:
                drain_deadline = time.monotonic() + self._drain_timeout_s
                log.info("draining: %d requests running, up to %.0f s", len(held.active), self._drain_timeout_s)
            if drain_deadline is not None and time.monotonic() > drain_deadline and held.active:
                held.end_all(ErrorInfo("The worker shut down before your request finished; please retry.",
                                       code="worker_shutdown", type="server_error", status=503))
                drain_deadline = float("inf")  # once
            if not (held.has_work() or self._engine_busy):
                if publishing is not None:
                    await _published(publishing)
                    publishing, ended_at = None, None
                    continue  # publishing may have let the intake add work
                if stop.is_set() and not held.preparing:
                    return
                held.work.clear()
                # Draining, requests still being prepared are waited for (they are held, or refused, next).
                await (first_of(held.work, timeout=1.0) if stop.is_set() else first_of(stop, held.work))
                continue
            adds, aborts = held.hand_over()
            started_at = time.perf_counter()
            if ended_at is not None:
                self.gap_s += started_at - ended_at
            loop = asyncio.get_running_loop()
            try:
                admission = (await loop.run_in_executor(self._step_thread, self._admit_sync, adds, aborts)
                             if adds or aborts else None)
                step = loop.run_in_executor(self._step_thread, self._step_sync, self._capacity.background_limit(),
                                            self._capacity.take_pause_rules())
                if publishing is not None:
                    await _published(publishing)
                    publishing = None
                if admission is not None:  # while the step runs, and before its deltas
                    await _published(self._publish_admission(admission))
                result = await step
            except Exception:
                if publishing is not None:  # the previous step's deltas before the errors
                    await _published(publishing)
                    publishing = None
                held.num_admitting = 0
                log.exception("engine step failed; failing %d running requests", len(held.active))
                await self._fail_all()
                for _, msg in adds:  # answered with the error: done with, not for another worker to retry
                    with contextlib.suppress(Exception):
                        await self._intake.ack(msg)
                ended_at = None
                continue
            held.num_admitting = 0
            self._engine_busy = result.has_unfinished
            freed = (admission is not None and bool(admission.rejected or admission.dropped)) or any(
                d.finish_reason for d in result.deltas)
            # Freed seats, or admissions that change who may take one.
            self._capacity.update(result.capacity, moved=freed or bool(adds) or bool(aborts))
            ended_at = time.perf_counter()
            self.num_steps += 1
            self.step_s += ended_at - started_at
            self._metrics.stepped(ended_at - started_at, result.stats)
            publishing = asyncio.create_task(self._publish(result))
            if freed and self._intake.queues.has_pending():
                # Let the intake refill the freed seats before the next step starts, not a whole step later;
                # bounded, so an empty queue costs at most a few milliseconds.
                self._intake.idle.clear()
                await first_of(self._intake.idle, timeout=REFILL_WAIT_S)

    def _admit_sync(self, adds: list[tuple[Tracked, Msg]], aborts: dict[str, ErrorInfo | None]) -> Admission:
        """Runs on the step thread, before a step: ``adds`` into the engine (or refused), ``aborts`` out of it."""
        engine = self._engine
        result = Admission()
        for tracked, msg in adds:
            if tracked.request.request_id in aborts:
                result.rejected.append((tracked, msg, aborts[tracked.request.request_id] or CANCELLED))
                continue
            if offer_expired(tracked.request):  # it waited here past its time: starting it would run it twice
                result.dropped.append((tracked, msg))
                continue
            prepared = tracked.prepared
            assert prepared is not None  # the intake holds a request only once it is prepared
            try:
                tracked.prompt_tokens = engine.add_request(tracked.request, prepared)
                tracked.dropped_messages = prepared.num_dropped_messages
            except RequestRejected as exc:
                result.rejected.append((tracked, msg, exc.error))
                continue
            except Exception:  # this request's alone (add_request leaves nothing behind): the others go on
                log.exception("could not add request %s", tracked.request.request_id)
                result.rejected.append((tracked, msg, ErrorInfo(
                    "The worker could not start your request.", code="internal_error", type="server_error",
                    status=500)))
                continue
            tracked.admitted_at = time.time()
            result.admitted.append((tracked, msg))
        for request_id, error in aborts.items():
            engine.abort_request(request_id, error)
        return result

    def _step_sync(self, background_limit: int | None, pause_after: dict[str, int] | None = None) -> StepResult:
        """Runs on the step thread: the only place the engine is touched (but ``prepare`` and ``_admit_sync``).
        ``pause_after``: the tiers' pausing quanta, when they changed (only for an engine that pauses)."""
        engine = self._engine
        result = StepResult()
        if pause_after is not None:
            engine.set_pause_rules(pause_after)
        if engine.has_unfinished_requests():
            result.deltas = engine.step(background_limit)
        result.has_unfinished = engine.has_unfinished_requests()
        result.capacity = engine.capacity()
        result.stats = engine.stats()
        result.safety_events = engine.take_safety_events()
        result.kv_changes = engine.take_kv_changes()
        return result

    async def _publish_admission(self, admission: Admission) -> None:
        """An admission's outcome, out: the refused requests' errors and the admitted ones' first messages
        (together: one message per gateway)."""
        held, out, metrics = self._held, self._out, self._metrics
        # Acks are confirmed round trips, retried through an outage: all at once, not one after another.
        await asyncio.gather(*(self._intake.ack(msg) for _, msg, _ in admission.rejected),
                             *(self._intake.ack(msg) for _, msg in (*admission.admitted, *admission.dropped)))
        step = StepDeltas()
        for tracked, _, error in admission.rejected:
            held.active.pop(tracked.request.request_id, None)
            await out.error(tracked.request, error, step)
        for tracked, _ in admission.dropped:
            held.active.pop(tracked.request.request_id, None)
        for tracked, _ in admission.admitted:
            req = tracked.request
            metrics.started(req.tier, tracked.admitted_at - req.created_at, tracked.prompt_tokens)
            self._intake.queues.charge(req.tier, req.tenant_id, prompt_tokens=tracked.prompt_tokens)
            await out.started(tracked, step)
        await out.send(step)
        if admission.rejected:
            self._capacity.changed.set()  # their seats were counted as held until now

    async def _publish(self, result: StepResult) -> None:
        """A step's outcome, out: its deltas (one message per gateway), then the records of what finished."""
        held, out, metrics = self._held, self._out, self._metrics
        metrics.safety_flagged(result.safety_events)  # counted before a client can see the halt
        if self._kv_events is not None:
            # Before the deltas: a client that reads a request's end and sends its next turn at once must find the
            # gateways' KV index knowing the seat it freed and the blocks it cached (a core NATS publish: no wait).
            await self._kv_events.publish(result.kv_changes, result.capacity)
        step = StepDeltas()
        now = time.time()
        generated: dict[str, int] = {}
        ended: list[tuple[Tracked, str]] = []
        for delta in result.deltas:
            running = held.active.get(delta.request_id)
            if running is None:
                continue
            req = running.request
            if delta.num_tokens:
                generated[req.tier] = generated.get(req.tier, 0) + delta.num_tokens
                self._intake.queues.charge(req.tier, req.tenant_id, generated_tokens=delta.num_tokens)
                if running.first_token_at is None:
                    running.first_token_at = now
            await out.relay(running, delta, step)
            if delta.is_last:  # every choice has ended (the engine counts them)
                # A choice's last delta has its finish reason (workers/serving/interface.py), the request's too.
                assert delta.finish_reason is not None, delta.request_id
                if delta.usage is not None:
                    running.completion_tokens = delta.usage.completion_tokens
                    running.cached_tokens = delta.usage.cached_tokens
                    running.kv_loaded_bytes = delta.usage.kv_loaded_bytes
                held.active.pop(req.request_id, None)
                self._intake.queues.finished(req.tier, req.tenant_id, running.prompt_tokens, running.completion_tokens)
                metrics.finished(req.tier, delta.finish_reason)
                if running.superseded:
                    metrics.dismissed(req.tier, running.prompt_tokens, running.completion_tokens)
                ended.append((running, delta.finish_reason))
        await out.send(step)  # before the records: a usage record retried through an outage holds no token back
        for tracked, finish_reason in ended:
            record_request_trace(tracked, out.worker_id, finish_reason, now)
            await out.finished(tracked, finish_reason, now)
        metrics.generated(generated)
        if ended:
            self._capacity.changed.set()  # their seats were counted as held until now

    async def _fail_all(self) -> None:
        """A step raised outside the engine's own recovery: every running request fails with a 500."""
        request_ids = list(self._held.active)
        capacity, busy = await asyncio.get_running_loop().run_in_executor(
            self._step_thread, self._abort_sync, request_ids)
        self._engine_busy = busy
        step = StepDeltas()
        for request_id in request_ids:
            tracked = self._held.active.pop(request_id, None)
            if tracked is not None:
                await self._out.error(tracked.request, ErrorInfo(
                    "The worker had an error processing your request.", code="internal_error",
                    type="server_error", status=500), step)
        await self._out.send(step)
        self._capacity.update(capacity)

    def _abort_sync(self, request_ids: list[str]) -> tuple[EngineCapacity | None, bool]:
        """On the step thread: abort ``request_ids``; the engine's capacity after it, and whether it is busy."""
        for request_id in request_ids:
            with contextlib.suppress(Exception):
                self._engine.abort_request(request_id)
        try:
            return self._engine.capacity(), self._engine.has_unfinished_requests()
        except Exception:
            log.exception("the engine could not report its capacity after a failed step")
            return None, True


async def _published(publishing: Awaitable[None]) -> None:
    """Wait for a step's (or an admission's) publishing; a failure there (NATS gone) is logged, never taken for a
    failed step."""
    try:
        await publishing
    except Exception:
        log.exception("publishing a step's outcome failed")

