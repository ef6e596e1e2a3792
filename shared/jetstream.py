"""Idempotent JetStream setup shared by gateways and workers: whoever starts first creates the streams, the
consumers and the workers' heartbeat bucket. The streams' shapes are in ``stream_config``."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time

from nats.aio.client import Client as NATS
from nats.errors import ConnectionReconnectingError, NoRespondersError, StaleConnectionError
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, KeyValueConfig, PubAck, StorageType, StreamConfig
from nats.js.errors import APIError, BadRequestError, BucketNotFoundError, NoStreamResponseError, NotFoundError
from nats.js.kv import KeyValue

from switchyard.shared import subjects
from switchyard.shared.messages import ErrorInfo, WorkerInfo, decode
from switchyard.shared.stream_config import (
    QUEUE_FULL_CODES,
    affinity_stream_config,
    batch_results_stream_config,
    dead_letter_stream_config,
    events_stream_config,
    held_writes_stream_config,
    tier_stream_config,
    usage_stream_config,
)
from switchyard.shared.tier_store import apply_queue_limits, read_policies, seed_policies
from switchyard.shared.tiers import TIER_NAMES

__all__ = ["QUEUE_FULL_CODES", "ensure_batch_results_consumer", "ensure_held_writes_consumer",
           "ensure_request_consumer", "ensure_streams",
           "ensure_usage_consumer", "is_transient", "publish_once", "workers_bucket"]

log = logging.getLogger("switchyard.jetstream")

WORKER_TTL_S = 10.0  # a worker whose heartbeat is this old is gone


def _stream_name(config: StreamConfig) -> str:
    """The stream's name (optional in nats-py's config; every config from ``stream_config`` has one)."""
    assert config.name is not None
    return config.name


async def _ensure_stream(js: JetStreamContext, config: StreamConfig, replicas: int) -> None:
    config.num_replicas = replicas
    try:
        await js.stream_info(_stream_name(config))
    except NotFoundError:
        try:
            await js.add_stream(config)
        except BadRequestError:
            # Lost a creation race with another process: the stream exists now, which is all we need.
            await js.stream_info(_stream_name(config))


async def _widen_subjects(js: JetStreamContext, config: StreamConfig) -> None:
    """Give a stream made by an earlier version today's subjects (HELD_WRITES held only ``llm.held.turn``), its
    messages kept."""
    info = await js.stream_info(_stream_name(config))
    if sorted(info.config.subjects or ()) != sorted(config.subjects or ()):
        info.config.subjects = config.subjects
        await js.update_stream(info.config)


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


async def _upgrade_request_stream(js: JetStreamContext, config: StreamConfig) -> None:
    """A tier stream of the earlier layout (a subject per model, no tenant token) takes today's subjects when it
    holds nothing; one still holding requests is refused clearly (nothing would consume them)."""
    info = await js.stream_info(_stream_name(config))
    if info.config.subjects == config.subjects:
        return
    if info.state.messages:
        raise RuntimeError(
            f"JetStream stream {config.name!r} from an earlier Switchyard still holds {info.state.messages} queued "
            f"requests under its old subjects {info.config.subjects}. Let it drain with the earlier version, or "
            f"purge it (losing those requests), then start again.")
    log.info("stream %s: subjects %s -> %s", config.name, info.config.subjects, config.subjects)
    await js.update_stream(dataclasses.replace(info.config, subjects=config.subjects,
                                               max_msgs=config.max_msgs,
                                               max_msgs_per_subject=config.max_msgs_per_subject))


async def _lift_consumer_limit(js: JetStreamContext, config: StreamConfig) -> None:
    """Give a queue stream made by an earlier version, which set no consumer limit, today's (stream_config.py says
    why: nats-server 2.15's default of 1,000 starves the 1,001st tenant); a limit an operator set is kept."""
    info = await js.stream_info(_stream_name(config))
    if (info.config.max_consumers or -1) <= 0 and config.max_consumers:
        log.info("stream %s: consumer limit -> %d", config.name, config.max_consumers)
        await js.update_stream(dataclasses.replace(info.config, max_consumers=config.max_consumers))


async def ensure_streams(js: JetStreamContext, replicas: int = 1, seed: bool = True) -> None:
    """Create the per-tier request streams, USAGE, EVENTS, BATCH_RESULTS and DEAD_LETTERS, and the tiers and
    workers buckets, if missing, and seed the tier policies.

    ``replicas``: how many servers of a JetStream cluster hold each stream and bucket (3 survives losing one
    node; ``SwitchyardConfig.nats_replicas``). It applies to what is created; existing streams keep their shape and
    live limits, so ops changes are never undone by a restart. ``seed``: False for a worker, whose NATS role may
    not write the tier policies (deploy/credentials.py); it reads the defaults of any tier not seeded yet.
    """
    await _drop_legacy_streams(js)
    if seed:
        await seed_policies(js, replicas)
    policies = await read_policies(js)
    for tier in TIER_NAMES:
        config = tier_stream_config(tier, policies[tier])
        await _ensure_stream(js, config, replicas)
        await _upgrade_request_stream(js, config)
        if seed:  # the gateway's role may update the queue streams; a worker's may not
            await _lift_consumer_limit(js, config)
            await apply_queue_limits(js, tier, policies[tier])  # an earlier version's one-hour age, say
    for config in (usage_stream_config(), events_stream_config(), batch_results_stream_config(),
                   held_writes_stream_config(), dead_letter_stream_config(), affinity_stream_config()):
        await _ensure_stream(js, config, replicas)
    if seed:
        await _lift_consumer_limit(js, affinity_stream_config())
    await _widen_subjects(js, held_writes_stream_config())
    await workers_bucket(js, replicas)


# How long a pulled request may go unacknowledged before JetStream hands it to another worker. A worker acks a
# request once it is running (its stream has begun) and, until then, says "in progress" every second (its liveness
# interval), so only a dead worker's pulled-but-not-started requests wait this long, not 30 s.
REQUEST_ACK_WAIT_S = 5.0


# A tenant's consumer that no worker has pulled from for this long is deleted by JetStream (tenants come and go;
# a returning tenant's first request has its consumer made again at once, one API call). Each consumer costs the
# server memory (and, replicated, a Raft group of its own), so the server holds those of the tenants active in this
# window: an hour held 1,400 of a soak's 500-tenant churn and grew NATS's memory 66% an hour.
REQUEST_CONSUMER_IDLE_S = 600.0


async def ensure_request_consumer(js: JetStreamContext, model: str, tier: str, tenant: str | None,
                                  ack_wait_s: float = REQUEST_ACK_WAIT_S) -> str:
    """Durable pull consumer of one tenant's queue of ``model`` in ``tier``, shared by every worker of the model;
    returns its name. An existing one of an earlier configuration is updated (JetStream edits it in place)."""
    name = subjects.request_consumer(model, tier, tenant)
    config = ConsumerConfig(
        durable_name=name,
        filter_subject=subjects.request_subject(model, tier, tenant),
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=ack_wait_s,
        max_deliver=5,
        inactive_threshold=REQUEST_CONSUMER_IDLE_S,
    )
    await js.add_consumer(subjects.request_stream(tier), config)
    return name


async def ensure_affinity_consumer(js: JetStreamContext, worker_id: str, tier: str) -> str:
    """Durable pull consumer of the requests offered to one worker in ``tier`` (deleted by JetStream once the
    worker is gone for a while); returns its name."""
    name = subjects.affinity_consumer(worker_id, tier)
    await js.add_consumer(subjects.AFFINITY_STREAM, ConsumerConfig(
        durable_name=name, filter_subject=subjects.affinity_subject(worker_id, tier), ack_policy=AckPolicy.EXPLICIT,
        ack_wait=REQUEST_ACK_WAIT_S, max_deliver=5, inactive_threshold=300.0))
    return name


async def queued_tenants(js: JetStreamContext, model: str, tier: str) -> dict[str, int]:
    """Tenant token -> requests in its queue of ``model`` in ``tier`` (taken but unacknowledged ones included)."""
    info = await js.stream_info(subjects.request_stream(tier),
                                subjects_filter=subjects.model_tier_subjects(model, tier))
    return {subject.rsplit(".", 1)[-1]: count for subject, count in (info.state.subjects or {}).items()}


async def ensure_usage_consumer(js: JetStreamContext) -> str:
    config = ConsumerConfig(
        durable_name=subjects.USAGE_CONSUMER,
        ack_policy=AckPolicy.EXPLICIT,
        ack_wait=30.0,
        max_deliver=-1,
    )
    await js.add_consumer(subjects.USAGE_STREAM, config)
    return subjects.USAGE_CONSUMER


async def ensure_held_writes_consumer(js: JetStreamContext, subject: str = subjects.HELD_TURN_SUBJECT) -> str:
    """The durable consumer of one kind of held write (``llm.held.turn``, ``llm.held.response``); returns its name.
    The turns' consumer of an earlier version, which read the whole stream, is narrowed in place."""
    name = subjects.held_writes_consumer(subject)
    config = ConsumerConfig(durable_name=name, ack_policy=AckPolicy.EXPLICIT, ack_wait=30.0, max_deliver=-1,
                            filter_subject=subject)
    await js.add_consumer(subjects.HELD_WRITES_STREAM, config)
    return name


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


async def workers_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """Open (creating if needed) the KV bucket of worker heartbeats: entries expire after ``WORKER_TTL_S``.
    ``ensure_streams`` creates it with the configured replicas; one re-created after a lone server's restart (it is
    in memory) has one."""
    try:
        return await js.key_value(subjects.WORKERS_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(bucket=subjects.WORKERS_BUCKET, ttl=WORKER_TTL_S,
                                                        storage=StorageType.MEMORY, history=1, replicas=replicas))


HEADER_ROOM = 1024  # bytes of a message kept for its headers (the dedup id, trace context)


def oversize_error(nc: NATS, payload: bytes) -> ErrorInfo | None:
    """The 413 for a request ``payload`` that (with its headers) does not fit the server's max_payload, else
    None: the gateway answers it, a batch fails that line with it; never a 500."""
    room = nc.max_payload - HEADER_ROOM
    if len(payload) <= room:
        return None
    return ErrorInfo(f"The request is {len(payload)} bytes once encoded, more than one queue message holds "
                     f"({room} bytes); shorten the prompt or conversation.", code="request_too_large", status=413)


async def live_workers(js: JetStreamContext) -> list[WorkerInfo]:
    """Every worker heartbeat in the ``workers`` bucket: its keys from the bucket stream's subjects (one server-side
    query; nats-py's ``kv.keys()`` builds a consumer for it, which can answer "no keys" while workers are
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


# What a publish meets while a stream has no leader (a cluster electing one after losing a node: seconds) or the
# client is reconnecting: worth retrying. A full queue or a bad request is not.
_TRANSIENT = (NoStreamResponseError, NoRespondersError, NatsTimeoutError, asyncio.TimeoutError,
              ConnectionReconnectingError, StaleConnectionError)


def is_transient(exc: Exception) -> bool:
    """Whether a JetStream call that raised ``exc`` may succeed if tried again shortly."""
    return isinstance(exc, _TRANSIENT) or (isinstance(exc, APIError) and exc.code == 503
                                           and exc.err_code not in QUEUE_FULL_CODES)


async def publish_once(js: JetStreamContext, subject: str, payload: bytes, msg_id: str, within_s: float = 10.0,
                       headers: dict[str, str] | None = None) -> PubAck:
    """Publish to a stream, retrying transient failures for up to ``within_s`` seconds; returns the ack.

    Every try carries ``msg_id`` (``Nats-Msg-Id``), so a try that was stored although its ack was lost is not
    stored again: whatever happens, the record lands at most once, and at least once unless this raises.
    """
    started = time.monotonic()
    deadline = started + within_s
    delay, tries = 0.05, 0
    while True:
        tries += 1
        try:
            ack = await js.publish(subject, payload, timeout=max(0.2, min(2.0, deadline - time.monotonic())),
                                   headers={"Nats-Msg-Id": msg_id, **(headers or {})})
            if tries > 1:
                log.warning("published %s to %s after %d tries, %.1f s", msg_id, subject, tries,
                            time.monotonic() - started)
            return ack
        except Exception as exc:
            if not is_transient(exc) or time.monotonic() + delay > deadline:
                raise
        await asyncio.sleep(delay)
        delay = min(2 * delay, 1.0)
