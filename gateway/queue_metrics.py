"""The gateway's gauges of what waits in JetStream and Postgres, refreshed every few seconds: per model and tier the
queue's depth, oldest wait and token backlog (read by domain/queues.py, as the CLI reads them), a prefill pool's
queue as a model of its own (``<model>~prefill``, what KEDA scales that pool on), the billing writer's lag, batch
lines by state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from nats.js import JetStreamContext

from switchyard.domain.batches import LINE_STATES, Batches
from switchyard.domain.database import Database, DatabaseUnavailable
from switchyard.domain.queues import billing_lag, queue_state
from switchyard.domain.registry import ModelRegistry
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.shared import subjects
from switchyard.shared.tiers import TIER_NAMES

log = logging.getLogger("switchyard.gateway")

POLL_INTERVAL_S = 5.0


class QueuePoller:
    """Refreshes the gauges every ``interval_s`` until cancelled; a read that fails leaves the last values."""

    def __init__(self, metrics: GatewayMetrics, js: JetStreamContext, registry: ModelRegistry, db: Database,
                 batches: Batches, interval_s: float = POLL_INTERVAL_S) -> None:
        self._metrics, self._js, self._registry, self._db, self._batches = metrics, js, registry, db, batches
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None
        # The prefill queues of the models a prefill worker was seen for: kept once seen, so a pool scaled to zero
        # reads an empty queue rather than the last depth.
        self._prefill_queues: set[str] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.poll()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # NATS or Postgres away: the gauges keep their last values
                log.debug("queue metrics: %r", exc)
            await asyncio.sleep(self._interval_s)

    async def poll(self) -> None:
        m = self._metrics
        served = await self._registry.models()
        # Configured models too: a queue gauge exists before any worker does (KEDA wakes the first one on it).
        m.served_models.update(served, self._registry.catalog_models)
        self._prefill_queues.update(subjects.prefill_queue(model) for model, workers in served.items()
                                    if any(w.role == "prefill" for w in workers))
        for model in sorted(m.served_models | self._prefill_queues):
            for tier in TIER_NAMES:
                state = await queue_state(self._js, model, tier)
                m.queue_depth.labels(model, tier).set(state.depth)
                m.queue_oldest_age.labels(model, tier).set(state.oldest_age_s or 0.0)
                m.queue_backlog_tokens.labels(model, tier).set(state.backlog_tokens)
        records, lag_s = await billing_lag(self._js)
        m.billing_lag_records.set(records)
        m.billing_lag_seconds.set(lag_s)
        with contextlib.suppress(DatabaseUnavailable):
            counts = await self._db.run(lambda _: self._batches.active_line_counts())  # bounded, behind the breaker
            for line_state in LINE_STATES:
                m.batch_lines.labels(line_state).set(counts.get(line_state, 0))
