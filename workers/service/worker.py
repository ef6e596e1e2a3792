"""The worker process's async loop: NATS in, ``Engine.step()`` in a thread, NATS out.

    intake task ── fetch (higher tiers first, only as many as the engine can admit) ──┐
                   └ tokenize + chat template on the intake thread (own tokenizer)     │ pending adds
    doorbell sub  llm.req.<model>.>  (core NATS: wakes intake when work arrives)       │
    cancel sub    llm.cancel.>       ──────────────────────────────────────────────────┤ pending aborts
    step loop ── step thread: admit + engine.step() ───────────────────────────────────┘
              └─ step N's deltas go out (llm.tok.<id>, llm.usage) while step N+1 runs
    heartbeat task ── KV workers/<model>.<worker_id>

A batch line (``result_subject`` set) also gets a durable ``BatchResult`` on that subject: a "started" marker when
admitted, and its whole outcome (texts, usage or error) when it ends, for the gateway's batch runner.

Model work runs off the event loop, so heartbeats, cancels, intake and publishing go on while a step runs. The
engine is touched only from inside that one thread call, so it needs no locks; the intake thread has a tokenizer of
its own (a fast tokenizer is not safe to share between threads).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
import socket
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec

from switchyard.scheduler.background import BackgroundPolicy
from switchyard.scheduler.tier_share import TierShare
from switchyard.shared import nats_client, subjects
from switchyard.shared.jetstream import ensure_streams, is_transient, workers_bucket
from switchyard.shared.messages import (
    BatchResult,
    ErrorInfo,
    GenerateRequest,
    TokenDelta,
    WorkerInfo,
    decode,
    encode,
)
from switchyard.shared.tier_store import PolicyCache
from switchyard.shared.tiers import BATCH_TIER, DEFAULT_POLICIES, get_tier, tiers_by_priority
from switchyard.shared.tracing import extract_context
from switchyard.workers.engine.prompts import RequestRejected, prepare_prompt
from switchyard.workers.engine.stats import EngineStats
from switchyard.workers.service.metrics import WorkerMetrics
from switchyard.workers.service.publisher import Publisher, Tracked, attempt_of
from switchyard.workers.service.request_trace import record_request_trace
from switchyard.workers.service.tenant_queues import TenantQueues

log = logging.getLogger("switchyard.worker")

_FETCH_TIMEOUT_S = 0.05  # per fetch; only tiers that may have work are asked
_IDLE_SWEEP_S = 1.0  # look at the queues this often even without a doorbell (redeliveries, missed rings)
_REFILL_WAIT_S = 0.02  # how long a step waits for the intake to refill freed seats
_EARLY_CANCEL_S = 60.0  # how long a cancel for a request not (yet) here is remembered
_ACK_RETRY_S = 10.0
_CANCELLED = ErrorInfo("cancelled", code="cancelled", status=499)  # the client went away (never mutated)


@dataclass(slots=True)
class _StepResult:
    admitted: list[tuple[Tracked, object]] = field(default_factory=list)  # (tracked, jetstream msg)
    rejected: list[tuple[Tracked, object, ErrorInfo]] = field(default_factory=list)
    deltas: list[TokenDelta] = field(default_factory=list)
    stats: EngineStats | None = None  # the engine after the step, for the metrics
    safety_events: list = field(default_factory=list)  # the output filter's verdicts (output_filter.SafetyEvent)


class Worker:
    """Serves one model from the REQUESTS stream until ``stop`` is set, then drains running requests."""

    def __init__(self, engine, model_name: str, nats_url: str, background: BackgroundPolicy,
                 step_thread: ThreadPoolExecutor, heartbeat_s: float = 3.0, drain_timeout_s: float = 60.0,
                 nats_replicas: int = 1, nats_tls_ca=None, metrics: WorkerMetrics | None = None,
                 metrics_url: str = "", aliases: list[str] | None = None) -> None:
        """``background``: how much batch-tier work may hold seats and run while interactive traffic is about.
        ``step_thread``: a one-thread executor, the thread that built ``engine``; every step runs there (torch's
        OpenMP pool belongs to the calling thread, and a second pool slows every matmul down).
        ``drain_timeout_s``: once ``stop`` is set, how long running requests get to finish (see ``run``).
        ``nats_replicas``: the replication of the streams and buckets it creates if it starts first.
        ``nats_tls_ca``: the CA its NATS server's certificate is checked against (None: the system's).
        ``metrics``/``metrics_url``: where it records its Prometheus metrics, and where they are served (put in its
        heartbeat so they can be found). ``aliases``: more names clients may use for the model (in its heartbeat)."""
        self.engine = engine
        self.model_name = model_name
        self.worker_id = uuid.uuid4().hex[:12]
        self._started_at = time.time()
        self._nats_url = nats_url
        self._heartbeat_s = heartbeat_s
        self._drain_timeout_s = drain_timeout_s
        self._nats_replicas = nats_replicas
        self._nats_tls_ca = nats_tls_ca
        self._active: dict[str, Tracked] = {}
        self._pending_adds: list[tuple[Tracked, object]] = []
        self._pending_aborts: dict[str, ErrorInfo | None] = {}  # None: the client cancelled
        # Pulled requests not yet acked (not running yet): marked in progress each second, so JetStream hands them
        # to another worker within its short ack wait only if this one dies. Keyed by id(msg): a redelivered copy
        # of one request is a message of its own.
        self._unacked: dict[int, object] = {}
        # Cancels that arrived before their request: one fetched just as it was cancelled (a batch cancel deletes
        # queued messages, but one may already be on its way here) must not run. Insertion (= time) ordered.
        self._early_cancels: dict[str, float] = {}
        self._work = asyncio.Event()
        self._wake = asyncio.Event()
        self._capacity = asyncio.Event()
        # The queues a tier and tenant each (made in run): which may have work (doorbell, sweep) and whose turn
        # it is. An empty fetch costs its whole timeout, so queues known to be empty are not asked.
        self._queues: TenantQueues | None = None
        self._num_admitting = 0  # handed to the step running now, not yet in the engine
        self._jump_headroom = max(1, engine.max_num_seqs // 8)
        self._intake_idle = asyncio.Event()  # the intake has nothing more to take right now
        self._background = background
        self._intake_tokenizer = copy.deepcopy(engine.tokenizer)
        self._intake_thread = ThreadPoolExecutor(1, thread_name_prefix="switchyard-intake")
        self._step_thread = step_thread
        self.num_steps, self.step_s, self.gap_s = 0, 0.0, 0.0  # see WorkerInfo
        self.metrics = metrics or WorkerMetrics(model_name)
        self._metrics_url = metrics_url
        self._aliases = list(aliases or [])

    # -- capacity ---------------------------------------------------------------------------------------
    def _num_admittable(self) -> int:
        # Requests handed to the running step are in neither list nor the engine yet: count them too.
        return self.engine.num_free_slots - len(self._pending_adds) - self._num_admitting

    def _num_interactive_active(self) -> int:
        return sum(t.request.tier != BATCH_TIER for t in self._active.values())

    def _background_limit(self) -> int | None:
        """How many batch-tier sequences may run in the next step; None: no limit."""
        return self._background.step_limit(self._num_interactive_active())

    def _may_take_batch(self) -> bool:
        held = sum(t.request.tier == BATCH_TIER for t in self._active.values())
        held += sum(t.request.tier == BATCH_TIER for t, _ in self._pending_adds)
        return self._background.may_take_background(held, self._num_interactive_active())

    def _jump_ins(self) -> dict[str, set[str]]:
        """With every seat taken, who may still send a few requests (the engine gives them a running request's
        seat, Scheduler._victim_for): tiers strictly more important than the least important running request,
        so a pro request never waits in JetStream for a free one to finish; and, in that least important tier,
        tenants holding two seats fewer than the tenant holding the most, so one tenant's flood cannot keep the
        others out of the batch. Tier -> tenant tokens that may not (empty: any). Bounded by ``_jump_headroom``
        waiting at once."""
        # Requests pulled beyond the seats: new ones waiting in the engine or on their way in (not ones taking free
        # seats, nor ones preempted to make room: they were pulled long ago).
        beyond = (self.engine.num_running + self.engine.num_waiting_new + len(self._pending_adds)
                  + self._num_admitting - self.engine.max_num_seqs)
        if beyond >= self._jump_headroom or not self._active:
            return {}
        least = max(get_tier(t.request.tier).priority for t in self._active.values())
        jumps = {t.name: set() for t in tiers_by_priority() if t.priority < least}
        least_tier = next(t.name for t in tiers_by_priority() if t.priority == least)
        held = Counter(subjects.tenant_token(t.request.tenant_id) for t in self._active.values()
                       if t.request.tier == least_tier)
        most = max(held.values(), default=0)
        if most >= 2:  # a tenant holding none may take one of the most-holding tenant's seats
            jumps[least_tier] = {tenant for tenant, n in held.items() if n + 2 > most}
        return jumps

    # -- main ---------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        nc = await nats_client.connect(self._nats_url, f"switchyard-worker-{self.worker_id}",
                                       tls_ca=self._nats_tls_ca, reconnected_cb=on_reconnect)
        self._nc, self._js = nc, nc.jetstream()
        self._out = Publisher(nc, self._js, self.worker_id)
        try:
            await ensure_streams(self._js, self._nats_replicas)
            self._queues = TenantQueues(self._js, self.model_name, [t.name for t in tiers_by_priority()],
                                        self.worker_id)
            await self._queues.sweep()  # work queued before this worker started rings no doorbell
            self._policies = PolicyCache(self._js)
            doorbell = await nc.subscribe(
                f"{subjects.REQUEST_PREFIX}.{subjects.model_token(self.model_name)}.>", cb=self._on_doorbell
            )
            offers = await nc.subscribe(f"{subjects.AFFINITY_PREFIX}.{self.worker_id}.*", cb=self._on_doorbell)
            cancels = await nc.subscribe(f"{subjects.CANCEL_PREFIX}.*", cb=self._on_cancel)
            kv = await workers_bucket(self._js)
            await self._beat(kv)
            # Heartbeats go on through the drain: a draining worker still serves its model, and the batch runner
            # must not take its running lines for lost.
            drained = asyncio.Event()
            heartbeat = asyncio.create_task(self._heartbeat_loop(kv, drained, reconnected))
            alive = asyncio.create_task(self._alive_loop(drained))
            intake = asyncio.create_task(self._intake_loop(stop))
            log.info("worker %s serving %s (context %d)", self.worker_id, self.model_name, self.engine.max_context)
            if ready is not None:
                ready.set()
            await self._step_loop(stop)
            drained.set()
            intake.cancel()
            heartbeat.cancel()
            alive.cancel()
            for task in (intake, heartbeat, alive):
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            with contextlib.suppress(Exception):
                await kv.delete(subjects.worker_key(self.model_name, self.worker_id))
            for sub in (doorbell, offers, cancels):
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await self._queues.close()
        finally:
            self._intake_thread.shutdown(wait=False, cancel_futures=True)
            await nc.close()

    async def _on_doorbell(self, msg) -> None:
        if self._queues is not None and self._queues.ring(msg.subject):
            self._wake.set()

    async def _on_cancel(self, msg) -> None:
        request_id = msg.subject.rsplit(".", 1)[-1]
        if msg.data:
            # Addressed to one worker: a gateway took it for dead and continued the request on another. Only
            # that worker stops (the continuation shares the request id), and it leaves the billing to the other.
            if msg.data.decode(errors="replace") != self.worker_id:
                return
            tracked = self._active.get(request_id)
            if tracked is not None:
                tracked.superseded = True
            elif not self._holds(request_id):
                return  # the run it addresses ended here already: a continuation of it arriving later must run
        if self._holds(request_id):
            self._pending_aborts.setdefault(request_id, None)
            self._work.set()
            return
        now = time.monotonic()
        self._early_cancels[request_id] = now  # the newest entry: the loop below stops at it at the latest
        while next(iter(self._early_cancels.values())) < now - _EARLY_CANCEL_S:
            del self._early_cancels[next(iter(self._early_cancels))]

    async def _beat(self, kv) -> None:
        running: dict[str, int] = {}
        for tracked in list(self._active.values()):
            running[tracked.request.tier] = running.get(tracked.request.tier, 0) + 1
        info = WorkerInfo(self.worker_id, self.model_name, self.engine.max_context, self._started_at, running,
                          self.num_steps, self.step_s, self.gap_s, host=socket.gethostname(), pid=os.getpid(),
                          metrics_url=self._metrics_url, aliases=self._aliases)
        await kv.put(subjects.worker_key(self.model_name, self.worker_id), encode(info))

    async def _alive_loop(self, done: asyncio.Event) -> None:
        """Liveness pings for the gateways relaying this worker's requests (see gateway/liveness.py)."""
        subject = subjects.alive_subject(self.worker_id)
        while True:
            with contextlib.suppress(Exception):  # NATS away: the gateways' relays time out on their own
                await self._nc.publish(subject, b"")
                for msg in list(self._unacked.values()):
                    await msg.in_progress()
            if await _set_within(done, subjects.ALIVE_INTERVAL_S):
                return

    async def _heartbeat_loop(self, kv, done: asyncio.Event, reconnected: asyncio.Event) -> None:
        """Beat every ``heartbeat_s``, and at once after a reconnect: a restarted NATS lost the in-memory bucket,
        and until this worker is listed again its model answers 503 (the bucket is made again if need be)."""
        last_state = ""
        while True:
            await _first_of(done, reconnected, timeout=self._heartbeat_s)
            if done.is_set():
                return
            reconnected.clear()
            try:
                await self._beat(kv)
            except Exception as exc:  # the bucket gone with a restarted server, or NATS still reconnecting
                log.warning("heartbeat failed: %s", exc)
                with contextlib.suppress(Exception):
                    kv = await workers_bucket(self._js, self._nats_replicas)
                    await self._beat(kv)
            state = self._state_summary()
            if state != last_state:  # what an operator (or a failing test's log) needs to see a stall
                log.info("state: %s", state)
                last_state = state

    def _state_summary(self) -> str:
        e = self.engine
        pending = self._queues.summary() if self._queues else {}
        return (f"active={len(self._active)} pending_adds={len(self._pending_adds)} admitting={self._num_admitting} "
                f"running={e.num_running} waiting={e.num_waiting} free_slots={e.num_free_slots} "
                f"kv_usage={e.scheduler.kv_cache.usage:.2f} maybe_pending={pending} "
                f"intake_idle={self._intake_idle.is_set()} background_limit={self._background_limit()}")

    # -- intake ---------------------------------------------------------------------------------------------
    async def _intake_loop(self, stop: asyncio.Event) -> None:
        """Pull one request at a time while the engine can admit more: from the tier the weighted tier share picks,
        and within it from the tenant the token-weighted tenant share picks (workers/service/tenant_queues.py).

        Taking one at a time keeps both shares exact and the backlog in JetStream, where any worker can take it.
        """
        tiers = [t.name for t in tiers_by_priority()]
        share = TierShare({t: p.weight for t, p in DEFAULT_POLICIES.items()},
                          {t.name: t.priority for t in tiers_by_priority()}, batch_tier=BATCH_TIER)
        queues = self._queues
        while not stop.is_set():
            excluded: dict[str, set[str]] = {}  # tier -> tenants that may not be pulled from now
            if self._num_admittable() > 0:
                eligible = set(tiers)
            else:
                excluded = self._jump_ins()
                eligible = {tier for tier, out in excluded.items() if queues.has_work(tier, out)}
            if BATCH_TIER in eligible and not self._may_take_batch():
                eligible.discard(BATCH_TIER)  # its seats while interactive traffic is about are taken
            if not eligible & queues.pending_tiers():
                self._intake_idle.set()
                self._capacity.clear()
                self._wake.clear()
                await _first_of(self._capacity, self._wake, timeout=_IDLE_SWEEP_S)
                if not self._capacity.is_set() and not self._wake.is_set():
                    # Redeliveries and work queued before we subscribed ring no doorbell: look everywhere.
                    await queues.sweep()
                continue
            self._intake_idle.clear()
            try:
                share.set_weights({t: p.weight for t, p in (await self._policies.get()).items()})
            except Exception as exc:  # NATS reconnecting: keep the weights we had
                log.warning("could not refresh tier policies: %s", exc)
            self._wake.clear()
            took = False
            for tier in share.order():
                if tier not in eligible:
                    continue
                if tier not in queues.pending_tiers():
                    share.note_empty(tier)
                    continue
                msg = await queues.take(tier, _FETCH_TIMEOUT_S, excluded.get(tier, set()))
                if msg is None:
                    share.note_empty(tier)
                    continue
                if await self._receive(msg):
                    share.charge(tier)
                took = True
                break  # start over: the shares decide again for the next request
            if not took:
                share.note_idle()

    async def _receive(self, msg) -> int:
        try:
            request = decode(msg.data, GenerateRequest)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("terminating malformed request message on %s", msg.subject)
            await msg.term()
            return 0
        if request.resume is not None and self._holds(request.request_id):
            # A continuation of a request this worker was just told to give up (its stream broke on the way to
            # the gateway): taken back once the abort is through.
            await msg.nak(delay=0.2)
            return 0
        if self._holds(request.request_id):
            # JetStream redelivered a request this worker runs (its ack was lost): the copy is dropped, the
            # original goes on; answering the copy would end the original's stream.
            log.warning("dropping a redelivered copy of running request %s", request.request_id)
            await msg.ack()
            return 0
        if request.affinity_until and time.time() > request.affinity_until:
            # An offer this worker took too late: the gateway has given the request to every worker by now.
            await msg.ack()
            return 0
        self._unacked[id(msg)] = msg
        now = time.time()
        tracked = Tracked(request, received_at=now, trace_context=extract_context(msg.headers))
        self._background.note_arrival(is_background=request.tier == BATCH_TIER)
        if now > request.deadline_at:
            return await self._refuse(request, msg, ErrorInfo(
                f"The request waited in the {request.tier} queue past its deadline and was not run; retry later.",
                code="queue_timeout", type="rate_limit_error", status=503))
        try:
            tracked.prepared = await asyncio.get_running_loop().run_in_executor(
                self._intake_thread, prepare_prompt, self._intake_tokenizer, request, self.engine.max_context,
                self.engine.grammars, self.engine.vocab_size)
        except RequestRejected as exc:
            return await self._refuse(request, msg, exc.error)
        except Exception:  # this request's alone: the others, and the intake, go on
            log.exception("could not tokenize request %s", request.request_id)
            return await self._refuse(request, msg, ErrorInfo(
                "The worker could not tokenize the request.", code="internal_error", type="server_error", status=500))
        # Checked after tokenizing: a cancel may have come before the request or while it was tokenized (a batch
        # cancel deletes the queued message and counts the line as never started), and either way it must not run.
        if self._early_cancels.pop(request.request_id, None) is not None:
            return await self._refuse(request, msg, _CANCELLED)
        self._pending_adds.append((tracked, msg))
        self._work.set()
        return 1

    async def _refuse(self, request: GenerateRequest, msg, error: ErrorInfo) -> int:
        """Answer a request taken from the queue with ``error`` instead of running it; it is done with (acked)."""
        try:
            await self._out.error(request, error)
        finally:
            await self._ack(msg)  # dropped from the in-progress marks whatever happens: never held forever
        return 0

    async def _ack(self, msg) -> None:
        """Acknowledge a request for good: confirmed by the server, retried through a cluster's leader election
        (an ack lost there would have JetStream hand a finished request to a worker again)."""
        self._unacked.pop(id(msg), None)
        deadline = time.monotonic() + _ACK_RETRY_S
        while True:
            try:
                await msg.ack_sync(timeout=1.0)
                return
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() > deadline:
                    log.warning("could not acknowledge %s: %r", msg.subject, exc)
                    return
            await asyncio.sleep(0.2)

    def _holds(self, request_id: str) -> bool:
        """Whether ``request_id`` is running here or waiting for the next step."""
        return request_id in self._active or any(t.request.request_id == request_id for t, _ in self._pending_adds)

    # -- steps ----------------------------------------------------------------------------------------------
    def _step_sync(self, adds, aborts: dict[str, ErrorInfo | None], background_limit: int | None) -> _StepResult:
        """Runs in a worker thread: the only place the engine is touched."""
        result = _StepResult()
        for tracked, msg in adds:
            if tracked.request.request_id in aborts:
                error = aborts[tracked.request.request_id] or _CANCELLED
                result.rejected.append((tracked, msg, error))
                continue
            try:
                tracked.prompt_tokens = self.engine.add_request(tracked.request, tracked.prepared)
                tracked.dropped_messages = self.engine.num_dropped_messages(tracked.request.request_id)
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
            self.engine.abort_request(request_id, error)
        if self.engine.has_unfinished_requests():
            result.deltas = self.engine.step(background_limit)
        result.stats = self.engine.stats()
        result.safety_events = self.engine.safety.take_events()
        return result

    async def _step_loop(self, stop: asyncio.Event) -> None:
        """Steps back to back while there is work. Step N's outcome is published while step N+1 runs (the
        publishing of one step always ends before the next step's starts, so deltas stay in order)."""
        publishing: asyncio.Task | None = None
        ended_at: float | None = None  # when the previous step ended, if the loop went straight on
        drain_deadline: float | None = None
        while True:
            if stop.is_set() and drain_deadline is None:
                drain_deadline = time.monotonic() + self._drain_timeout_s
                log.info("draining: %d requests running, up to %.0f s", len(self._active), self._drain_timeout_s)
            if drain_deadline is not None and time.monotonic() > drain_deadline and self._active:
                self._end_all(ErrorInfo("The worker shut down before your request finished; please retry.",
                                        code="worker_shutdown", type="server_error", status=503))
                drain_deadline = float("inf")  # once
            has_work = self._pending_adds or self._pending_aborts or self.engine.has_unfinished_requests()
            if not has_work:
                if publishing is not None:
                    await _published(publishing)
                    publishing, ended_at = None, None
                    continue  # publishing may have let the intake add work
                if stop.is_set():
                    return
                self._work.clear()
                stop_wait = asyncio.ensure_future(stop.wait())
                work_wait = asyncio.ensure_future(self._work.wait())
                await asyncio.wait({stop_wait, work_wait}, return_when=asyncio.FIRST_COMPLETED)
                stop_wait.cancel()
                work_wait.cancel()
                continue
            adds, self._pending_adds = self._pending_adds, []
            aborts, self._pending_aborts = self._pending_aborts, {}
            for tracked, _ in adds:
                self._active[tracked.request.request_id] = tracked
            self._num_admitting = len(adds)
            started_at = time.perf_counter()
            if ended_at is not None:
                self.gap_s += started_at - ended_at
            step = asyncio.get_running_loop().run_in_executor(
                self._step_thread, self._step_sync, adds, aborts, self._background_limit())
            if publishing is not None:
                await _published(publishing)
                publishing = None
            try:
                result = await step
            except Exception:
                log.exception("engine step failed; failing %d running requests", len(self._active))
                await self._fail_all()
                for _, msg in adds:  # answered with the error: done with, not for another worker to retry
                    with contextlib.suppress(Exception):
                        await self._ack(msg)
                ended_at = None
                continue
            finally:
                self._num_admitting = 0
            ended_at = time.perf_counter()
            self.num_steps += 1
            self.step_s += ended_at - started_at
            self.metrics.stepped(ended_at - started_at, result.stats)
            publishing = asyncio.create_task(self._publish_result(result))
            freed = bool(result.rejected) or any(d.finish_reason for d in result.deltas)
            self._capacity.set()  # freed seats, or admissions that change who may jump in: let the intake look
            if freed and self._queues.has_pending():
                # Let the intake refill the freed seats before the next step starts, not a whole step later;
                # bounded, so an empty queue costs at most a few milliseconds.
                self._intake_idle.clear()
                await _first_of(self._intake_idle, timeout=_REFILL_WAIT_S)

    async def _publish_result(self, result: _StepResult) -> None:
        """Publish a step's outcome: rejections, admissions, deltas, and the records of what finished."""
        self.metrics.safety_flagged(result.safety_events)  # counted before a client can see the halt
        # Acks are confirmed round trips, retried through an outage: all of a step's at once, not one after another.
        await asyncio.gather(*(self._ack(msg) for _, msg, _ in result.rejected),
                             *(self._ack(msg) for _, msg in result.admitted))
        for tracked, msg, error in result.rejected:
            self._active.pop(tracked.request.request_id, None)
            await self._out.error(tracked.request, error)
        for tracked, msg in result.admitted:
            self.metrics.started(tracked.request.tier, tracked.admitted_at - tracked.request.created_at,
                                 tracked.prompt_tokens)
            self._queues.charge(tracked.request.tier, tracked.request.tenant_id, prompt_tokens=tracked.prompt_tokens)
            await self._out.delta(TokenDelta(tracked.request.request_id, dropped_messages=tracked.dropped_messages,
                                             prompt_tokens=tracked.prompt_tokens,
                                             attempt=attempt_of(tracked.request)))
            if tracked.request.result_subject:
                await self._out.batch_result(tracked.request, BatchResult(
                    tracked.request.request_id, self.worker_id, started=True))
        now = time.time()
        generated: dict[str, int] = {}
        for delta in result.deltas:
            tracked = self._active.get(delta.request_id)
            if tracked is None:
                continue
            if delta.num_tokens:
                generated[tracked.request.tier] = generated.get(tracked.request.tier, 0) + delta.num_tokens
                self._queues.charge(tracked.request.tier, tracked.request.tenant_id, generated_tokens=delta.num_tokens)
            if delta.num_tokens and tracked.first_token_at is None:
                tracked.first_token_at = now
            delta.attempt = attempt_of(tracked.request)
            await self._out.delta(delta)
            if tracked.request.result_subject:
                tracked.collect(delta)
            if delta.finish_reason is not None:
                tracked.num_finished += 1
                if delta.usage is not None:
                    tracked.completion_tokens = delta.usage.completion_tokens
                    tracked.cached_tokens = delta.usage.cached_tokens
                if tracked.num_finished >= tracked.request.sampling.n:
                    self._active.pop(tracked.request.request_id, None)
                    self.metrics.finished(tracked.request.tier, delta.finish_reason)
                    record_request_trace(tracked, self.worker_id, delta.finish_reason, now)
                    await self._out.finished(tracked, delta.finish_reason, now)
        self.metrics.generated(generated)

    def _end_all(self, error: ErrorInfo) -> None:
        """End every running request with ``error`` at the next step (its final deltas carry it)."""
        log.warning("ending %d running requests: %s", len(self._active), error.code)
        self._pending_aborts.update(dict.fromkeys(self._active, error))

    async def _fail_all(self) -> None:
        for request_id, tracked in list(self._active.items()):
            with contextlib.suppress(Exception):
                self.engine.abort_request(request_id)
            await self._out.error(tracked.request, ErrorInfo(
                "The worker had an error processing your request.", code="internal_error", type="server_error",
                status=500))
            self._active.pop(request_id, None)
        self._capacity.set()


async def _published(task: asyncio.Task) -> None:
    """Wait for a step's publishing; a failure there (NATS gone) is logged, never taken for a failed step."""
    try:
        await task
    except Exception:
        log.exception("publishing a step's outcome failed")


async def _set_within(event: asyncio.Event, timeout: float) -> bool:
    """Wait up to ``timeout`` seconds for ``event``; whether it is set."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(event.wait(), timeout)
    return event.is_set()


async def _first_of(*events: asyncio.Event, timeout: float) -> None:
    """Wait until any of ``events`` is set, or ``timeout`` seconds."""
    waiters = [asyncio.ensure_future(e.wait()) for e in events]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for w in waiters:
            w.cancel()
