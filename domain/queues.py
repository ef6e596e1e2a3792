"""What waits in JetStream, read the same way by the gateway's gauges (gateway/queue_metrics.py), ``switchyard
tiers show``, ``switchyard top`` and the admin API, so they all agree: per model and tier the queue's depth, its
oldest request's age and its backlog in tokens; the billing writer's lag.
"""

from __future__ import annotations

import datetime as dt
import time

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from switchyard.domain.limits import estimate_tokens
from switchyard.shared import subjects
from switchyard.shared.jetstream import queued_tenants
from switchyard.shared.messages import GenerateRequest, UsageRecord, decode

# Queued requests read per model and tier to estimate the token backlog; a deeper queue is extrapolated from
# their mean (reading every message of a 100 000-line batch queue each poll would cost more than it tells).
BACKLOG_SAMPLE = 64


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
    # Counted from the stream, not from the consumer's num_pending: nats-server updates that after acking the
    # publish, so a record just stored could read as none waiting; the stream's sequences are set before the ack.
    # The consumer reads the whole stream, so every record still in it past the last delivered one waits for it.
    state = (await js.stream_info(subjects.USAGE_STREAM)).state
    delivered = (info.delivered.stream_seq or 0) if info.delivered is not None else 0
    undelivered = max(0, state.last_seq - max(delivered, state.first_seq - 1))
    pending = undelivered + (info.num_ack_pending or 0)
    if not pending:
        return 0, 0.0
    floor = info.ack_floor.stream_seq if info.ack_floor is not None else 0
    try:
        msg = await js.get_msg(subjects.USAGE_STREAM, seq=(floor or 0) + 1, next=True)
        record = decode(msg.data or b"", UsageRecord)  # an empty message is as undecodable as a corrupt one
        ended_at = record.created_at + record.total_ms / 1000
        return pending, max(0.0, time.time() - ended_at)
    except (NotFoundError, msgspec.MsgspecError):
        return pending, 0.0
