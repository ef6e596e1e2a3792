"""What waits in JetStream and Postgres, read every few seconds into the gateway's gauges: per model and tier the
queue's depth, its oldest request's age and its backlog in tokens; the billing writer's lag; batch lines by state.

``queue_state`` is also what ``switchyard tiers show`` prints, so the CLI and the dashboards agree.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from switchyard.gateway.database import Database, DatabaseUnavailable
from switchyard.gateway.limits import estimate_tokens
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.registry import ModelRegistry
from switchyard.shared import subjects
from switchyard.shared.jetstream import queued_tenants
from switchyard.shared.messages import GenerateRequest, UsageRecord, decode
from switchyard.shared.tiers import TIER_NAMES

log = logging.getLogger("switchyard.gateway")

POLL_INTERVAL_S = 5.0
# Queued requests read per model and tier to estimate the token backlog; a deeper queue is extrapolated from
# their mean (reading every message of a 100 000-line batch queue each poll would cost more than it tells).
BACKLOG_SAMPLE = 64

_ACTIVE_BATCH_LINES_SQL = """
SELECT l.status, count(*) AS n FROM batch_lines l JOIN batches b ON b.id = l.batch_id
WHERE b.status IN ('validating', 'in_progress', 'finalizing', 'cancelling') GROUP BY l.status
"""
BATCH_LINE_STATES = ("pending", "queued", "completed", "failed", "cancelled")


class QueueState(msgspec.Struct):
    depth: int  # requests not yet started by a worker (a few taken but not yet started included)
    oldest_age_s: float | None  # the oldest request still in the stream (None: empty)
    backlog_tokens: int  # estimated, see BACKLOG_SAMPLE


def _age_s(stored_at: dt.datetime | None) -> float | None:
    return None if stored_at is None else max(0.0, time.time() - stored_at.timestamp())


def _request_tokens(data: bytes) -> int:
    try:
        req = decode(data, GenerateRequest)
    except msgspec.MsgspecError:
        return 0
    chars = len(req.prompt or "") + sum(len(m.content) for m in req.messages or ())
    return estimate_tokens(chars, req.sampling.max_tokens, req.sampling.n)


async def queue_state(js: JetStreamContext, model: str, tier: str) -> QueueState:
    """The queue of ``model`` in ``tier`` (every tenant's), read from its stream."""
    stream, subject = subjects.request_stream(tier), subjects.model_tier_subjects(model, tier)
    try:
        depth = sum((await queued_tenants(js, model, tier)).values())
    except NotFoundError:
        depth = 0
    if not depth:
        return QueueState(0, None, 0)
    oldest, tokens, seq, read = None, 0, 1, 0
    while read < min(depth, BACKLOG_SAMPLE):
        try:
            msg = await js.get_msg(stream, seq=seq, subject=subject, next=True)
        except NotFoundError:
            break
        oldest = oldest or msg.time
        tokens += _request_tokens(msg.data or b"")
        seq, read = (msg.seq or seq) + 1, read + 1
    backlog = tokens if read >= depth or not read else round(tokens / read * depth)
    return QueueState(depth, _age_s(oldest), backlog)


async def billing_lag(js: JetStreamContext) -> tuple[int, float]:
    """Usage records not yet written to Postgres, and the age of the oldest (0 when none)."""
    try:
        info = await js.consumer_info(subjects.USAGE_STREAM, subjects.USAGE_CONSUMER)
    except NotFoundError:
        return 0, 0.0
    pending = (info.num_pending or 0) + (info.num_ack_pending or 0)
    if not pending:
        return 0, 0.0
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    try:
        msg = await js.get_msg(subjects.USAGE_STREAM, seq=(floor or 0) + 1, next=True)
        record = decode(msg.data, UsageRecord)
        ended_at = record.created_at + record.total_ms / 1000
        return pending, max(0.0, time.time() - ended_at)
    except (NotFoundError, msgspec.MsgspecError):
        return pending, 0.0


class QueuePoller:
    """Refreshes the gauges every ``interval_s`` until cancelled; a read that fails leaves the last values."""

    def __init__(self, metrics: GatewayMetrics, js: JetStreamContext, registry: ModelRegistry, db: Database,
                 interval_s: float = POLL_INTERVAL_S) -> None:
        self._metrics, self._js, self._registry, self._db = metrics, js, registry, db
        self._interval_s = interval_s
        self._task: asyncio.Task | None = None

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
        for model in sorted(m.served_models):
            for tier in TIER_NAMES:
                state = await queue_state(self._js, model, tier)
                m.queue_depth.labels(model, tier).set(state.depth)
                m.queue_oldest_age.labels(model, tier).set(state.oldest_age_s or 0.0)
                m.queue_backlog_tokens.labels(model, tier).set(state.backlog_tokens)
        records, lag_s = await billing_lag(self._js)
        m.billing_lag_records.set(records)
        m.billing_lag_seconds.set(lag_s)
        with contextlib.suppress(DatabaseUnavailable):
            rows = await self._db.run(lambda pool: pool.fetch(_ACTIVE_BATCH_LINES_SQL))
            counts = {r["status"]: r["n"] for r in rows}
            for state in BATCH_LINE_STATES:
                m.batch_lines.labels(state).set(counts.get(state, 0))
