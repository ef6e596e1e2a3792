"""Idempotent JetStream setup shared by gateways and workers: whoever starts first creates the streams."""

from __future__ import annotations

import contextlib

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, NotFoundError

from switchyard.shared import subjects
from switchyard.shared.tiers import TIER_NAMES

# JetStream's error code for a publish refused because a stream or subject limit is reached (discard-new).
ERR_MAX_MSGS = 10077
ERR_MAX_MSGS_PER_SUBJECT = 10078
QUEUE_FULL_CODES = {ERR_MAX_MSGS, ERR_MAX_MSGS_PER_SUBJECT}

REQUEST_MAX_AGE_S = 3600.0
USAGE_MAX_AGE_S = 30 * 24 * 3600.0
EVENTS_MAX_AGE_S = 300.0
BATCH_RESULTS_MAX_AGE_S = 7 * 24 * 3600.0


def tier_stream_config(tier: str, max_queued: int) -> StreamConfig:
    # Discard-new per subject makes JetStream itself refuse work beyond a tier's cap for one model, whatever the
    # number of gateways; the refusal reaches the publisher synchronously, so the client gets 429 at once.
    return StreamConfig(
        name=subjects.request_stream(tier),
        subjects=[subjects.tier_subjects(tier)],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_msgs_per_subject=max_queued,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        max_age=REQUEST_MAX_AGE_S,
        duplicate_window=120.0,
    )


def events_stream_config() -> StreamConfig:
    """Short-lived operational events (429s per model and tier) that `tiers show` counts."""
    return StreamConfig(
        name=subjects.EVENTS_STREAM,
        subjects=[f"{subjects.EVENTS_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY,
        max_age=EVENTS_MAX_AGE_S,
    )


def usage_stream_config() -> StreamConfig:
    return StreamConfig(
        name=subjects.USAGE_STREAM,
        subjects=[subjects.USAGE_SUBJECT],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=USAGE_MAX_AGE_S,
        duplicate_window=600.0,
    )


def batch_results_stream_config() -> StreamConfig:
    """Batch lines' outcomes, kept until the batch runner has written them to Postgres (and a while after)."""
    return StreamConfig(
        name=subjects.BATCH_RESULTS_STREAM,
        subjects=[f"{subjects.RESULT_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE,
        max_age=BATCH_RESULTS_MAX_AGE_S,
        duplicate_window=600.0,
    )


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError:
            # Lost a creation race with another process: the stream exists now, which is all we need.
            await js.stream_info(config.name)


# Streams of earlier layouts whose subjects overlap today's: JetStream refuses a new stream that overlaps them.
_LEGACY_STREAMS = ("REQUESTS",)  # one stream for every tier, before the per-tier streams


async def _drop_legacy_streams(js: JetStreamContext) -> None:
    """Delete an earlier layout's stream when it holds nothing; refuse clearly when it still holds requests."""
    for name in _LEGACY_STREAMS:
        try:
            info = await js.stream_info(name)
        except NotFoundError:
            continue
        if info.state.messages:
            raise RuntimeError(
                f"JetStream stream {name!r} from an earlier Switchyard still holds {info.state.messages} queued "
                f"requests, and its subjects overlap the per-tier streams. Let it drain with the earlier version, or "
                f"delete it (losing those requests), then start again.")
        with contextlib.suppress(NotFoundError):  # another process (gateway or worker) deleted it first
            await js.delete_stream(name)


async def ensure_streams(js: JetStreamContext) -> None:
    """Create the per-tier request streams, USAGE and EVENTS if missing, and seed the tier policies.

    Existing streams keep their live limits: ops changes are never undone by a restart.
    """
    from switchyard.shared.tier_store import read_policies, seed_policies

    await _drop_legacy_streams(js)
    await seed_policies(js)
    policies = await read_policies(js)
    for tier in TIER_NAMES:
        await _ensure_stream(js, tier_stream_config(tier, policies[tier].max_queued))
    await _ensure_stream(js, usage_stream_config())
    await _ensure_stream(js, events_stream_config())
    await _ensure_stream(js, batch_results_stream_config())


async def ensure_request_consumer(js: JetStreamContext, model: str, tier: str, ack_wait_s: float = 30.0) -> str:
    """Durable pull consumer shared by all workers of ``model`` for ``tier``; returns its name."""
    name = subjects.request_consumer(model, tier)
    config = ConsumerConfig(
        durable_name=name,
        filter_subject=subjects.request_subject(model, tier),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=5,
    )
    await js.add_consumer(subjects.request_stream(tier), config)
    return name


async def ensure_usage_consumer(js: JetStreamContext) -> str:
    config = ConsumerConfig(
        durable_name=subjects.USAGE_CONSUMER,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30.0,
        max_deliver=-1,
    )
    await js.add_consumer(subjects.USAGE_STREAM, config)
    return subjects.USAGE_CONSUMER


async def ensure_batch_results_consumer(js: JetStreamContext) -> str:
    """The batch runner's durable pull consumer: whichever gateway leads binds to it and resumes where the last
    leader stopped acking."""
    config = ConsumerConfig(
        durable_name=subjects.BATCH_RESULTS_CONSUMER,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30.0,
        max_deliver=-1,
    )
    await js.add_consumer(subjects.BATCH_RESULTS_STREAM, config)
    return subjects.BATCH_RESULTS_CONSUMER
