"""Idempotent JetStream setup shared by gateways and workers: whoever starts first creates the streams."""

from __future__ import annotations

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

from shared import subjects

# JetStream's error code for a publish refused because a stream or subject limit is reached (discard-new).
ERR_MAX_MSGS = 10077
ERR_MAX_MSGS_PER_SUBJECT = 10078
QUEUE_FULL_CODES = {ERR_MAX_MSGS, ERR_MAX_MSGS_PER_SUBJECT}

DEFAULT_MAX_QUEUED_PER_SUBJECT = 1000
REQUEST_MAX_AGE_S = 3600.0
USAGE_MAX_AGE_S = 30 * 24 * 3600.0


def request_stream_config(max_queued_per_subject: int = DEFAULT_MAX_QUEUED_PER_SUBJECT) -> StreamConfig:
    # Discard-new per subject makes JetStream itself refuse work beyond a tier's cap, whatever the number of
    # gateways; the refusal reaches the publisher synchronously, so the client gets 429 at once.
    return StreamConfig(
        name=subjects.REQUEST_STREAM,
        subjects=[f"{subjects.REQUEST_PREFIX}.>"],
        retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE,
        max_msgs_per_subject=max_queued_per_subject,
        discard=DiscardPolicy.NEW,
        discard_new_per_subject=True,
        max_age=REQUEST_MAX_AGE_S,
        duplicate_window=120.0,
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


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.stream_info(config.name)
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError:
            # Lost a creation race with another process: the stream exists now, which is all we need.
            await js.stream_info(config.name)


async def ensure_streams(js: JetStreamContext) -> None:
    """Create the REQUESTS and USAGE streams if missing; existing ones (and their live limits) are kept."""
    await _ensure_stream(js, request_stream_config())
    await _ensure_stream(js, usage_stream_config())


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
    await js.add_consumer(subjects.REQUEST_STREAM, config)
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
