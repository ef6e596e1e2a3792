"""A worker's intake: requests in from JetStream, as far as its capacity allows.

    doorbell  llm.req.<model>.> and llm.aff.<worker>.*  ──▶ which queues may have work (tenant_queues.py)
    run()     capacity.allowance() ─▶ tier (TierShare) ─▶ tenants (TenantShare) ─▶ one message from each
    receive   decode ─▶ drop copies and stale offers ─▶ refuse past its deadline ─▶ held.preparing, and on
    prepare   engine.prepare on a prepare thread ─▶ refuse what can never run, or was cancelled meanwhile
              ─▶ held.add (the step loop adds it)
    cancels   llm.cancel.*: abort what is held; remember one for a request not here yet (it may be on its way)
    acks      once the engine took a request, or it was refused; until then marked in progress every second

Taking only what fits now keeps both shares exact and the backlog in JetStream, where any worker can take it; into
free seats the least served tenants' next requests are pulled side by side (one each, up to ``PULL_AT_ONCE``), so a
worker with hundreds of seats fills them at NATS's pace rather than one round trip per request.
Preparing a request (tokenizing, the chat template, compiling its grammar) runs on ``prepare_threads`` threads of
the intake's own, so it never waits for a step and a step never waits for it; the pull goes on meanwhile, and a
tenant with a request being prepared is not pulled for until it is ready (capacity.py): one tenant's slow prompts
(a huge schema, thousands of messages) hold one thread and delay that tenant alone, never another tenant's turn.
A tenant whose prompt took over ``SLOW_PREPARE_S`` of CPU has its next ones prepared on a slow lane at a lower
CPU priority (workers/cpu_priority.py) for ``DEMOTED_S``, one at a time with rests between (they hold the GIL), and
every grammar compiles on such threads (workers/serving/guided.py): what one tenant's expensive prompts cost is
taken from what serving leaves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from nats.aio.msg import Msg

from switchyard.scheduler.tier_share import TierShare
from switchyard.shared.jetstream import is_transient
from switchyard.shared.messages import ErrorInfo, GenerateRequest, decode
from switchyard.shared.tier_store import PolicyCache
from switchyard.shared.tiers import BATCH_TIER, DEFAULT_POLICIES, tiers_by_priority
from switchyard.shared.tracing import extract_context
from switchyard.workers.cpu_priority import lower_priority
from switchyard.workers.service.capacity import Capacity
from switchyard.workers.service.held import HeldRequests, Tracked
from switchyard.workers.service.publisher import Publisher
from switchyard.workers.service.tenant_queues import TenantQueues
from switchyard.workers.service.waiting import first_of
from switchyard.workers.serving.interface import RequestRejected, ServingEngine

log = logging.getLogger("switchyard.worker")

FETCH_TIMEOUT_S = 1.0  # per pull, for an answer lost on the way: an empty queue answers in 50 ms (pulls.py)
PULL_AT_ONCE = 16  # requests pulled side by side into free seats, at most (each from another tenant)
SWEEP_EVERY_S = 1.0  # look at the queues this often whatever rang (redeliveries, missed rings, slow fetches)
EARLY_CANCEL_S = 60.0  # how long a cancel for a request not (yet) here is remembered
ACK_RETRY_S = 10.0
CANCELLED = ErrorInfo("cancelled", code="cancelled", status=499)  # the client went away (never mutated)


def offer_expired(request: GenerateRequest) -> bool:
    """An offer (``affinity_until``) past its time: the gateway has given the request to every worker by now."""
    return bool(request.affinity_until) and time.time() > request.affinity_until


SLOW_PREPARE_S = 0.02  # CPU a prompt may take to prepare before its tenant's next ones go to the slow lane
DEMOTED_S = 10.0
SLOW_LANE_REST = 2.0  # the slow lane rests this many times the CPU its last prepare took (see _on_slow_lane)
SLOW_LANE_MAX_REST_S = 1.0


class _Failed(Exception):
    """A prepare that raised: what the client gets, and the CPU it cost."""

    def __init__(self, error: ErrorInfo, cpu_s: float) -> None:
        self.error, self.cpu_s = error, cpu_s


def _timed(prepare, request: GenerateRequest):
    """``prepare(request)`` on this thread, and the CPU seconds it took; raises ``_Failed``."""
    start = time.thread_time()
    try:
        return prepare(request), time.thread_time() - start
    except RequestRejected as exc:
        raise _Failed(exc.error, time.thread_time() - start) from exc
    except Exception as exc:  # this request's alone: the others, and the intake, go on
        log.exception("could not tokenize request %s", request.request_id)
        raise _Failed(ErrorInfo("The worker could not tokenize the request.", code="internal_error",
                                type="server_error", status=500), time.thread_time() - start) from exc


class Intake:
    """See the module docstring. ``idle`` is set while it has nothing it may take (the step loop waits for it
    after freeing seats, so that they are refilled before the next step starts)."""

    def __init__(self, engine: ServingEngine[Any], nc, js, model_name: str, worker_id: str, held: HeldRequests,
                 capacity: Capacity, out: Publisher, prepare_threads: int = 2) -> None:
        self._engine = engine
        self._worker_id = worker_id
        self._held = held
        self._capacity = capacity
        self._out = out
        self.queues = TenantQueues(nc, js, model_name, [t.name for t in tiers_by_priority()], worker_id)
        self._policies = PolicyCache(js)
        self._wake = asyncio.Event()
        self.idle = asyncio.Event()
        # Pulled requests not yet acked (not running yet): marked in progress each second, so JetStream hands them
        # to another worker within its short ack wait only if this one dies. Keyed by id(msg): a redelivered copy
        # of one request is a message of its own.
        self._unacked: dict[int, Msg] = {}
        # Cancels that arrived before their request: one fetched just as it was cancelled (a batch cancel deletes
        # queued messages, but one may already be on its way here) must not run. Insertion (= time) ordered.
        self._early_cancels: dict[str, float] = {}
        self._threads = ThreadPoolExecutor(prepare_threads, thread_name_prefix="switchyard-prepare")
        # A tenant whose last prompt took over SLOW_PREPARE_S of CPU to prepare has its next ones prepared here, at a
        # lower CPU priority, for DEMOTED_S: its expensive prompts take what serving leaves.
        self._slow_lane = ThreadPoolExecutor(1, thread_name_prefix="switchyard-prepare-slow",
                                             initializer=lower_priority)
        self._demoted: dict[str | None, float] = {}  # tenant id -> until when its prompts go to the slow lane
        self._forgiven_at = 0.0  # (monotonic) when the tenants past their time were last dropped
        self._slow_lane_turn = asyncio.Lock()
        self._slow_lane_rested_at = 0.0  # (monotonic) when the slow lane may start its next prepare
        self._preparing: set[asyncio.Task] = set()  # referenced until done (the loop keeps only weak references)

    async def sweep(self) -> None:
        """Learn which queues hold work from the streams themselves (work queued before this worker started rings
        no doorbell)."""
        await self.queues.sweep(msg.subject for msg in list(self._unacked.values()))

    async def close(self) -> None:
        await self.queues.close()

    def shutdown(self) -> None:
        self._threads.shutdown(wait=False, cancel_futures=True)
        self._slow_lane.shutdown(wait=False, cancel_futures=True)

    # -- signals from NATS ----------------------------------------------------------------------------------
    async def on_doorbell(self, msg) -> None:
        if self.queues.ring(msg.subject):
            self._wake.set()

    def _supersede(self, request_id: str, attempt: int) -> None:
        """Stop, unbilled, the run of ``request_id`` held here if it is an attempt before ``attempt``."""
        tracked = self._held.active.get(request_id) or self._held.preparing.get(request_id)
        if tracked is None or tracked.superseded or tracked.request.attempt >= attempt:
            return
        log.warning("request %s: attempt %d here is stale (attempt %d is queued): stopping it", request_id,
                    tracked.request.attempt, attempt)
        tracked.superseded = True
        self._out.drop_stream(tracked.request)
        if self._held.holds(request_id):
            self._held.abort(request_id)
        else:  # still being prepared: it is refused once it is
            self._early_cancels[request_id] = time.monotonic()

    async def on_cancel(self, msg) -> None:
        request_id = msg.subject.rsplit(".", 1)[-1]
        if msg.data:
            # Addressed to one worker (``<worker id>[:<attempt>]``): a gateway took it for dead and continued the
            # request on another, or it runs an attempt the gateway has moved on from. Only that worker stops (the
            # continuation shares the request id), and it leaves the billing to the other; with an attempt, only
            # that attempt's run (a later one here goes on).
            target, _, attempt = msg.data.decode(errors="replace").partition(":")
            if target != self._worker_id:
                return
            tracked = self._held.tracked(request_id)
            if tracked is None:
                return  # the run it addresses ended here already: a continuation of it arriving later must run
            if attempt and str(tracked.request.attempt) != attempt:
                return  # a later attempt taken here (back from a stall, it pulled the continuation): it goes on
            if self._held.active.get(request_id) is tracked:
                tracked.superseded = True
                self._out.drop_stream(tracked.request)
        if self._held.holds(request_id):
            self._held.abort(request_id)
            return
        now = time.monotonic()
        self._early_cancels[request_id] = now  # the newest entry: the loop below stops at it at the latest
        while next(iter(self._early_cancels.values())) < now - EARLY_CANCEL_S:
            del self._early_cancels[next(iter(self._early_cancels))]

    # -- pulling --------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Pull while the capacity allows: from the tier the weighted tier share picks, and within it from the
        tenants the token-weighted tenant share picks, least served first (tenant_queues.py)."""
        share = TierShare({t: p.weight for t, p in DEFAULT_POLICIES.items()},
                          {t.name: t.priority for t in tiers_by_priority()}, batch_tier=BATCH_TIER)
        queues = self.queues
        swept_at = time.monotonic()
        while not stop.is_set():
            if time.monotonic() - swept_at > SWEEP_EVERY_S:
                # Redeliveries and work queued before we subscribed ring no doorbell, and a tenant whose fetch came
                # back empty (a slow server) is forgotten until it rings again: look everywhere, every second, busy
                # or not (sweeping only when idle would leave a tenant unserved while others' work keeps the intake
                # awake).
                await self.sweep()
                swept_at = time.monotonic()
                await self._refresh_policies(share)
            allowed = self._capacity.allowance()
            # Only queues that may hold a request of a tenant not left out (seat takers, tenants being prepared):
            # a tier whose only tenants are left out has nothing yet.
            # Offers only into free seats: a seat taken for fairness is a tenant's turn, not an offer's.
            offers = allowed.num_free_seats > 0
            eligible = {tier for tier, out in allowed.pull.items()
                        if queues.has_work(tier, out, offers or not out, allowed.pause_over.get(tier))}
            if not eligible & queues.pending_tiers():
                self.idle.set()
                self._capacity.changed.clear()
                self._wake.clear()
                await first_of(self._capacity.changed, self._wake, timeout=SWEEP_EVERY_S)
                continue
            self.idle.clear()
            await self._refresh_policies(share)
            self._wake.clear()
            took = False
            for tier in share.order():
                if tier not in eligible:
                    continue
                if tier not in queues.pending_tiers():
                    share.note_empty(tier)
                    continue
                # Into free seats several at once (batch one at a time: its policy counts each seat it takes).
                count = min(allowed.num_free_seats, PULL_AT_ONCE) if tier != BATCH_TIER else 1
                msgs = await queues.take_many(tier, max(1, count), FETCH_TIMEOUT_S, allowed.pull[tier],
                                              offers or not allowed.pull[tier], allowed.pause_over.get(tier))
                if not msgs:
                    share.note_empty(tier)
                    continue
                for msg in msgs:
                    if await self._receive(msg):
                        share.charge(tier)
                took = True
                break  # start over: the shares decide again for the next request
            if not took:
                share.note_idle()

    async def _refresh_policies(self, share: TierShare) -> None:
        """The live tier policies (cached for a second): the tiers' weights for the pulls, their pausing quanta for
        the capacity (and through it the engine). Read each second even while nothing may be pulled: turning
        pausing on is what lets a waiting tenant be pulled then."""
        try:
            policies = await self._policies.get()
        except Exception as exc:  # NATS reconnecting: keep the weights we had
            log.warning("could not refresh tier policies: %s", exc)
            return
        share.set_weights({t: p.weight for t, p in policies.items()})
        self._capacity.set_pause_after({t: p.pause_after_tokens for t, p in policies.items()})

    async def _receive(self, msg) -> int:
        """Take one message: 1 when its request goes on to be prepared, 0 when it was dropped or refused."""
        try:
            request = decode(msg.data, GenerateRequest)
        except (msgspec.DecodeError, msgspec.ValidationError):
            log.error("terminating malformed request message on %s", msg.subject)
            await msg.term()
            return 0
        if request.resume is not None and self._held.has_taken(request.request_id):
            # A continuation of a request this worker runs an earlier attempt of: one it was just told to give up
            # (its stream broke on the way to the gateway), or a copy it started after the gateway had moved on (a
            # prefill offer's fallback whose prefill handed over). The gateway publishes an attempt only once it
            # is done with the earlier ones: that run stops, unbilled, and the continuation is taken back once the
            # abort is through.
            self._supersede(request.request_id, request.resume.attempt)
            await msg.nak(delay=0.2)
            return 0
        if (held := self._held.tracked(request.request_id)) is not None:
            # JetStream redelivered a request this worker runs (its ack was lost), or the gateway gave an offer
            # taken here to every worker (its first message was late): the copy is dropped, the original goes on;
            # answering the copy would end the original's stream. An offer held here is no longer one: past its
            # time it would be dropped before its step as given to others, and with this copy gone neither would run.
            if held.request.affinity_until and not request.affinity_until:
                held.request = msgspec.structs.replace(held.request, affinity_until=0.0)
            else:
                log.warning("dropping a redelivered copy of running request %s", request.request_id)
            await msg.ack()
            return 0
        if offer_expired(request):  # taken too late
            await msg.ack()
            return 0
        self._unacked[id(msg)] = msg
        now = time.time()
        tracked = Tracked(request, received_at=now, trace_context=extract_context(msg.headers))
        self._capacity.background.note_arrival(is_background=request.tier == BATCH_TIER)
        if now > request.deadline_at:
            return await self.refuse(request, msg, ErrorInfo(
                f"The request waited in the {request.tier} queue past its deadline and was not run; retry later.",
                code="queue_timeout", type="rate_limit_error", status=503))
        self._held.preparing[request.request_id] = tracked
        task = asyncio.create_task(self._prepare(tracked, msg))
        self._preparing.add(task)
        task.add_done_callback(self._preparing.discard)
        return 1

    async def _prepare(self, tracked: Tracked, msg) -> None:
        """Prepare a taken request on a prepare thread, then hand it to the step loop, or refuse it."""
        request, error = tracked.request, None
        now = time.monotonic()
        demoted = self._demoted.get(request.tenant_id, 0.0) > now
        try:
            if demoted:
                tracked.prepared, cpu_s = await self._on_slow_lane(request)
            else:
                tracked.prepared, cpu_s = await asyncio.get_running_loop().run_in_executor(
                    self._threads, _timed, self._engine.prepare, request)
            self._note_cost(request.tenant_id, cpu_s, now)
        except _Failed as failed:
            self._note_cost(request.tenant_id, failed.cpu_s, now)
            error = failed.error
        finally:
            self._held.preparing.pop(request.request_id, None)
            self._capacity.changed.set()  # its tenant may be pulled for again
            self._held.work.set()  # a drain waits for what is being prepared
        # Checked after tokenizing: a cancel may have come before the request or while it was tokenized (a batch
        # cancel deletes the queued message and counts the line as never started), and either way it must not run.
        if error is None and self._early_cancels.pop(request.request_id, None) is not None:
            error = CANCELLED
        if error is not None:
            await self.refuse(request, msg, error)
        else:
            self._held.add(tracked, msg)

    async def _on_slow_lane(self, request: GenerateRequest):
        """``_timed(prepare, request)`` on the slow lane, one at a time, each after the lane has rested
        ``SLOW_LANE_REST`` times the CPU its last prepare took. A chat template renders in Python, holding the GIL
        in slices that every serving thread waits out at each hand-off, whatever the thread's CPU priority: a
        tenant sending huge prompts back to back would keep the lane busy without pause, and every other tenant's
        first token would wait on it (tests/e2e/test_hostile_work.py). Resting, such prompts take at most a third
        of the interpreter, and the rest of the worker has it the other two thirds."""
        async with self._slow_lane_turn:
            rest = self._slow_lane_rested_at - time.monotonic()
            if rest > 0:
                await asyncio.sleep(rest)
            cpu_s = 0.0
            try:
                result = await asyncio.get_running_loop().run_in_executor(
                    self._slow_lane, _timed, self._engine.prepare, request)
                cpu_s = result[1]
                return result
            except _Failed as failed:
                cpu_s = failed.cpu_s
                raise
            finally:
                self._slow_lane_rested_at = time.monotonic() + min(SLOW_LANE_REST * cpu_s, SLOW_LANE_MAX_REST_S)

    def _note_cost(self, tenant_id: str | None, cpu_s: float, now: float) -> None:
        if cpu_s > SLOW_PREPARE_S:
            self._demoted[tenant_id] = now + DEMOTED_S
        # Tenants forgiven are dropped once every DEMOTED_S (a scan of the few demoted lately), so one that stopped
        # sending is not held for good: a worker sees tenants come and go for days.
        if now - self._forgiven_at > DEMOTED_S:
            self._forgiven_at = now
            self._demoted = {t: until for t, until in self._demoted.items() if until > now}

    # -- answering JetStream --------------------------------------------------------------------------------
    async def refuse(self, request: GenerateRequest, msg, error: ErrorInfo) -> int:
        """Answer a request taken from the queue with ``error`` instead of running it; it is done with (acked)."""
        try:
            await self._out.error(request, error)
        finally:
            await self.ack(msg)  # dropped from the in-progress marks whatever happens: never held forever
        return 0

    async def ack(self, msg) -> None:
        """Acknowledge a request for good: confirmed by the server, retried through a cluster's leader election
        (an ack lost there would have JetStream hand a finished request to a worker again)."""
        self._unacked.pop(id(msg), None)
        deadline = time.monotonic() + ACK_RETRY_S
        while True:
            try:
                await msg.ack_sync(timeout=1.0)
                return
            except Exception as exc:
                if not is_transient(exc) or time.monotonic() > deadline:
                    log.warning("could not acknowledge %s: %r", msg.subject, exc)
                    return
            await asyncio.sleep(0.2)

    async def mark_in_progress(self) -> None:
        """Tell JetStream the requests pulled but not started yet are still being handled (so it does not hand
        them to another worker after its ack wait)."""
        for msg in list(self._unacked.values()):
            await msg.in_progress()

    def tenant_state(self) -> dict[str, int]:
        """What the intake holds per tenant (shared/tenant_state.py): its queues' and fair shares', the slow lane's."""
        return {**self.queues.tenant_state(), "slow_lane_tenants": len(self._demoted)}

    def summary(self) -> str:
        return f"maybe_pending={self.queues.summary()} intake_idle={self.idle.is_set()}"
