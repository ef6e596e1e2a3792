"""Idempotent JetStream setup shared by gateways and workers: whoever starts first creates the streams, the
consumers and the workers' heartbeat bucket. The streams' shapes are in ``stream_config``."""

from __future__ import annotations

import contextlib

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, KeyValueConfig, StorageType, StreamConfig
from nats.js.errors import BadRequestError, BucketNotFoundError, NotFoundError

from switchyard.shared import subjects
from switchyard.shared.messages import ErrorInfo, WorkerInfo, decode
from switchyard.shared.stream_config import (
    QUEUE_FULL_CODES,
    batch_results_stream_config,
    dead_letter_stream_config,
    events_stream_config,
    tier_stream_config,
    usage_stream_config,
)
from switchyard.shared.tier_store import read_policies, seed_policies
from switchyard.shared.tiers import TIER_NAMES

__all__ = ["QUEUE_FULL_CODES", "ensure_batch_results_consumer", "ensure_request_consumer", "ensure_streams",
           "ensure_usage_consumer", "workers_bucket"]

WORKER_TTL_S = 10.0  # a worker whose heartbeat is this old is gone

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
    await _drop_legacy_streams(js)
    await seed_policies(js)
    policies = await read_policies(js)
    for tier in TIER_NAMES:
        await _ensure_stream(js, tier_stream_config(tier, policies[tier].max_queued))
    await _ensure_stream(js, usage_stream_config())
    await _ensure_stream(js, events_stream_config())
    await _ensure_stream(js, batch_results_stream_config())
    await _ensure_stream(js, dead_letter_stream_config())


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


async def workers_bucket(js: JetStreamContext):
    """Open (creating if needed) the KV bucket of worker heartbeats: entries expire after ``WORKER_TTL_S``."""
    try:
        return await js.key_value(subjects.WORKERS_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(
            KeyValueConfig(bucket=subjects.WORKERS_BUCKET, ttl=WORKER_TTL_S, storage=StorageType.MEMORY, history=1)
        )


HEADER_ROOM = 1024  # bytes of a message kept for its headers (the dedup id, trace context)


def oversize_error(nc, payload: bytes) -> ErrorInfo | None:
    """The 413 for a request ``payload`` that (with its headers) does not fit the server's max_payload, else
    None: the gateway answers it, a batch fails that line with it; never a 500."""
    room = nc.max_payload - HEADER_ROOM
    if len(payload) <= room:
        return None
    return ErrorInfo(f"The request is {len(payload)} bytes once encoded, more than one queue message holds "
                     f"({room} bytes); shorten the prompt or conversation.", code="request_too_large", status=413)


async def live_workers(js: JetStreamContext) -> list[WorkerInfo]:
    """Every worker heartbeat in the ``workers`` bucket: its keys from the bucket stream's subjects (one server-side
    query; nats-py's ``kv.keys()`` builds a consumer for it and was seen to answer "no keys" while workers were
    beating), then each key's last value. A restarted NATS has lost the in-memory bucket: it is made again, empty,
    and the workers' next heartbeats fill it."""
    stream, prefix = f"KV_{subjects.WORKERS_BUCKET}", f"$KV.{subjects.WORKERS_BUCKET}."
    try:
        info = await js.stream_info(stream, subjects_filter=f"{prefix}>")
    except NotFoundError:
        await workers_bucket(js)
        return []
    workers = []
    for subject in info.state.subjects or {}:
        try:
            msg = await js.get_last_msg(stream, subject)
        except NotFoundError:  # expired since the listing
            continue
        if msg.data:  # a deregistered worker's key ends in a delete marker, which has none
            workers.append(decode(msg.data, WorkerInfo))
    return workers
