"""The worker process's I/O shell around an engine: NATS in, ``engine.step()`` on a thread, NATS out.

    Worker (this module): connects, wires the parts below, starts them, and drains them on stop
    ├─ Intake (intake.py)       doorbells llm.req.<model>.> and offers llm.aff.<me>.*, cancels llm.cancel.*;
    │                           fetches what Capacity allows ─▶ engine.prepare (prepare threads) ─▶ held, or refused
    ├─ HeldRequests (held.py)   every request held: pending ─▶ active (handed to a step), and aborts
    ├─ Capacity (capacity.py)   the engine's capacity after its last step + what is held ─▶ Allowance,
    │                           asked by the intake (what to pull) and the step loop (batch per step)
    ├─ StepLoop (step_loop.py)  step thread: add, abort, engine.step(); publishes step N while N+1 runs; drains
    ├─ Publisher (publisher.py) deltas (llm.tok.gw.<gateway>, a step's at once), llm.usage records, batch lines;
    │                           a resumable stream's deltas kept (stream_replay.py)
    ├─ StreamTakeover (stream_takeover.py)  llm.gw.alive.* heard, llm.resume.* answered, orphans ended
    ├─ Liveness (liveness.py)   KV workers/<model>.<me> heartbeats, llm.alive.<me> pings (seats free), the state line
    ├─ KVEventPublisher (kv_events.py)  what the KV cache holds, per step, on llm.kv.<model>; snapshots
    └─ KVBlockExchange (kv_blocks.py)   this node's KV tiers served to other nodes, theirs fetched (llm.kvblk.*)
             │
             ▼ ServingEngine (workers/serving/interface.py): prepare, add_request, abort_request, step,
               capacity, stats, take_safety_events, shutdown
       an engine: pure, no I/O (ours: workers/engine/engine.py)

    a request: JetStream ─▶ Intake ─▶ HeldRequests ─▶ StepLoop ─▶ engine ─▶ StepLoop ─▶ Publisher ─▶ NATS

As vLLM's ``EngineCoreProc`` wraps its ``EngineCore``: the engine stays pure and replaceable, the shell owns I/O.
The engine is touched from the step thread alone (but ``prepare``), so it needs no locks; heartbeats, cancels,
intake and publishing go on while a step runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from switchyard.shared import nats_client, subjects
from switchyard.shared.config import SwitchyardConfig
from switchyard.shared.jetstream import ensure_streams
from switchyard.shared.messages import WorkerInfo
from switchyard.workers.service.capacity import Capacity, background_policy
from switchyard.workers.service.engines import is_test_double
from switchyard.workers.service.held import HeldRequests
from switchyard.workers.service.intake import Intake
from switchyard.workers.service.kv_blocks import KVBlockExchange
from switchyard.workers.service.kv_events import KVEventPublisher, node_id
from switchyard.workers.service.liveness import Liveness
from switchyard.workers.service.metrics import WorkerMetrics
from switchyard.workers.service.publisher import Publisher
from switchyard.workers.service.step_loop import StepLoop
from switchyard.workers.service.stream_replay import StreamReplays
from switchyard.workers.service.stream_takeover import StreamTakeover
from switchyard.workers.serving.interface import EngineUnavailable, ServingEngine

log = logging.getLogger("switchyard.worker")


class Worker:
    """Serves one model from the REQUESTS streams until ``stop`` is set, then drains running requests."""

    def __init__(self, engine: ServingEngine[Any], config: SwitchyardConfig, step_thread: ThreadPoolExecutor,
                 metrics: WorkerMetrics | None = None, metrics_url: str = "") -> None:
        """``config``: the settings, whole (the worker's section and how to reach NATS). ``step_thread``: a
        one-thread executor, the thread that built ``engine``; every step runs there (torch's OpenMP pool belongs
        to the calling thread, and a second pool slows every matmul down). ``metrics``/``metrics_url``: where it
        records its Prometheus metrics, and where they are served (put in its heartbeat so they can be found)."""
        self.engine = engine
        self.config = config
        self.model_name = config.worker.served_name
        self.role = config.worker.role
        if self.role not in engine.capabilities.roles:
            raise EngineUnavailable(f"the {config.worker.engine} engine cannot serve as a {self.role} worker (it "
                                    f"serves as: {', '.join(engine.capabilities.roles)})")
        # What it pulls: a prefill worker its model's prefill queue (the requests to hand over), any other the
        # model's own queues.
        self._queue = subjects.prefill_queue(self.model_name) if self.role == "prefill" else self.model_name
        self.worker_id = uuid.uuid4().hex[:12]
        self.metrics = metrics or WorkerMetrics(self.model_name)
        self._metrics_url = metrics_url
        self._started_at = time.time()
        self._step_thread = step_thread
        self._held = HeldRequests()
        # The engine's capacity before its first step: no step runs yet, so it may be read from here.
        self._capacity = Capacity(engine.capacity(), self._held, background_policy(config.worker, engine.device_type),
                                  pausing=engine.capabilities.pausing)
        self._intake: Intake | None = None
        self._steps: StepLoop | None = None
        self._stop: asyncio.Event | None = None  # run's: set, the worker drains (its heartbeat says so)

    async def run(self, stop: asyncio.Event, ready: asyncio.Event | None = None) -> None:
        """Connect, serve until ``stop``, drain, and leave the worker registry."""
        liveness: Liveness | None = None
        self._stop = stop
        replays = StreamReplays(self.worker_id, time.monotonic())  # resumable streams' deltas (stream_replay.py)

        async def on_reconnect() -> None:
            if liveness is not None:
                liveness.reconnected.set()
            replays.reconnected(time.monotonic())

        config = self.config
        assert config.nats_url is not None  # a worker is started only with one (switchyard/cli/serve.py)
        nc = await nats_client.connect(config.nats_url, f"switchyard-worker-{self.worker_id}",
                                       tls_ca=config.nats_tls_ca, reconnected_cb=on_reconnect)
        js = nc.jetstream()
        out = Publisher(nc, js, self.worker_id, replays)
        intake = self._intake = Intake(self.engine, nc, js, self._queue, self.worker_id, self._held,
                                       self._capacity, out, config.worker.prepare_threads)
        self.metrics.tenant_state.watch("intake", intake.tenant_state)
        self.metrics.tenant_state.watch("stream_replays", replays.tenant_state)
        try:
            await ensure_streams(js, config.nats_replicas, seed=False)
            await intake.sweep()
            model = subjects.model_token(self._queue)
            subscriptions = [
                await nc.subscribe(f"{subjects.REQUEST_PREFIX}.{model}.>", cb=intake.on_doorbell),
                await nc.subscribe(f"{subjects.AFFINITY_PREFIX}.{self.worker_id}.*", cb=intake.on_doorbell),
                await nc.subscribe(f"{subjects.CANCEL_PREFIX}.*", cb=intake.on_cancel),
            ]
            w = config.worker
            node = node_id(w.kv_offload_host_dir, w.kv_offload_dir)
            kv_events = KVEventPublisher(nc, self.engine, self.model_name, self.worker_id, node, self.role)
            await kv_events.start()
            takeover = StreamTakeover(nc, replays, out, self._held)
            await takeover.start()
            kv_blocks = KVBlockExchange(nc, self.model_name, node)
            if self.engine.capabilities.kv_exchange:
                await kv_blocks.start(self.engine.connect_kv_peers(kv_blocks))
            self._steps = StepLoop(self.engine, self._step_thread, self._held, self._capacity, intake, out,
                                   self.metrics, config.worker.drain_timeout_s, kv_events)
            liveness = Liveness(nc, js, self.model_name, self.worker_id, config.worker.heartbeat_s,
                                config.nats_replicas, self._info, self._state_summary, intake.mark_in_progress,
                                self._free_seats)
            await liveness.start()
            announcing = asyncio.create_task(liveness.beat_on(stop))
            pulling = asyncio.create_task(intake.run(stop))
            log.info("worker %s serving %s as %s (context %d) with the %s engine (%s)%s", self.worker_id,
                     self.model_name, self.role, self.engine.max_context, config.worker.engine,
                     self.engine.capabilities.describe(),
                     ", a TEST DOUBLE: its text is made up, no model runs" if is_test_double(config.worker.engine)
                     else "")
            if ready is not None:
                ready.set()
            await self._steps.run(stop)
            for task in (pulling, announcing):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            await liveness.stop()
            await takeover.stop()
            await kv_events.stop()
            await kv_blocks.stop()
            for sub in subscriptions:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
            await intake.close()
            await asyncio.get_running_loop().run_in_executor(self._step_thread, self.engine.shutdown)
        finally:
            intake.shutdown()
            await nc.close()

    def _info(self) -> WorkerInfo:
        """What the heartbeat says: the model, what runs per tier, and the step loop's counters."""
        steps = self._steps
        assert steps is not None  # heartbeats begin after the step loop is made (run)
        return WorkerInfo(self.worker_id, self.model_name, self.engine.max_context, self._started_at,
                          self._held.running_by_tier(), steps.num_steps, steps.step_s, steps.gap_s,
                          host=socket.gethostname(), pid=os.getpid(), metrics_url=self._metrics_url,
                          aliases=list(self.config.worker.aliases), engine=self.config.worker.engine,
                          test_double=is_test_double(self.config.worker.engine), role=self.role,
                          draining=self._stop is not None and self._stop.is_set())

    def _free_seats(self) -> int:
        """Requests it would pull now (none while draining): where a gateway may send a hedge."""
        assert self._stop is not None  # set by run before liveness pings
        return 0 if self._stop.is_set() else self._capacity.allowance().num_free_seats

    def _state_summary(self) -> str:
        assert self._intake is not None  # made by run before the liveness that asks for this line
        return (f"{self._capacity.summary()} {self._intake.summary()} "
                f"background_limit={self._capacity.allowance().background_limit}")
