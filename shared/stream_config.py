"""The shapes of Switchyard's JetStream streams: one place for their subjects, retention, limits and ages."""

from __future__ import annotations

from typing import Any

from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import APIError

from switchyard.shared import subjects
from switchyard.shared.tiers import BATCH_COMPLETION_WINDOW_S, TierPolicy, get_tier

# JetStream's error code for a publish refused because a stream (the tier) or subject (a tenant's queue) limit is
# reached (discard-new); nats-server 2.15 answers 10077 for both and tells them apart in the description.
ERR_MAX_MSGS = 10077
ERR_MAX_MSGS_PER_SUBJECT = 10078
QUEUE_FULL_CODES = {ERR_MAX_MSGS, ERR_MAX_MSGS_PER_SUBJECT}


def is_subject_cap(error: APIError) -> bool:
    """Whether a queue-full refusal is a subject's cap (one tenant's queue), not the whole stream's (the tier)."""
    return error.err_code == ERR_MAX_MSGS_PER_SUBJECT or "per subject" in (error.description or "")

# JetStream drops a queued request this long after the longest any request of its tier may wait: a backstop for a
# message nothing will ever answer, never a second deadline. A request's own deadline (the tier's max_wait_s; a
# batch line's is its batch's completion window) is kept by the gateway and the worker, which answer queue_timeout.
# A stream that dropped a request first would leave it unanswered: in a two-hour soak, batch lines that had waited
# an hour behind interactive load were dropped by an age of one hour, and their batches could not finish.
REQUEST_AGE_MARGIN_S = 3600.0


def request_max_age_s(tier: str, policy: TierPolicy) -> float:
    """How long the stream of ``tier`` keeps a queued request under ``policy``: an hour past the longest wait any of
    its requests may have been given."""
    longest = policy.max_wait_s
    if not get_tier(tier).interactive:
        longest = max(longest, BATCH_COMPLETION_WINDOW_S)
    return longest + REQUEST_AGE_MARGIN_S


# Consumers a request stream may hold: one per tenant and model queued in its tier within the last ten minutes
# (REQUEST_CONSUMER_IDLE_S), and one per worker for offers. Set on the stream because nats-server 2.15 gives a
# stream that sets none a default of 1,000 (``default_max_consumers``): the 1,001st tenant active in a tier would get
# no consumer, and its requests would wait in the stream until their deadline.
MAX_QUEUE_CONSUMERS = 1_000_000
USAGE_MAX_AGE_S = 30 * 24 * 3600.0
EVENTS_MAX_AGE_S = 300.0
BATCH_RESULTS_MAX_AGE_S = 7 * 24 * 3600.0
DEAD_LETTER_MAX_AGE_S = 30 * 24 * 3600.0


def tier_stream_config(tier: str, policy: TierPolicy) -> StreamConfig:
    # Discard-new makes JetStream itself refuse work beyond a tier's cap (every model) and beyond a tenant's cap
    # (each subject is one tenant's queue of one model), whatever the number of gateways; the refusal reaches the
    # publisher synchronously, so the client gets 429 at once.
    return _work_queue(subjects.request_stream(tier), subjects.tier_subjects(tier), request_max_age_s(tier, policy),
                       max_msgs=policy.max_queued, max_msgs_per_subject=policy.tenant_cap, discard=DiscardPolicy.NEW,
                       discard_new_per_subject=True, max_consumers=MAX_QUEUE_CONSUMERS)


def _work_queue(name: str, subject: str, max_age_s: float, **limits: Any) -> StreamConfig:
    """A file-backed queue of requests (each taken once, by one worker); a publish retried with its message id
    within two minutes is stored once."""
    return StreamConfig(name=name, subjects=[subject], retention=RetentionPolicy.WORK_QUEUE,
                        storage=StorageType.FILE, max_age=max_age_s, duplicate_window=120.0, **limits)


AFFINITY_MAX_AGE_S = 300.0


def affinity_stream_config() -> StreamConfig:
    """Requests offered to the one worker that holds their prefix; one it does not take within its short wait
    is published to the shared queue too (gateway/affinity.py), and the worker drops its stale copy, so nothing
    waits here for long. File storage: an offered request is an accepted one."""
    return _work_queue(subjects.AFFINITY_STREAM, f"{subjects.AFFINITY_PREFIX}.>", AFFINITY_MAX_AGE_S,
                       max_consumers=MAX_QUEUE_CONSUMERS)


def events_stream_config() -> StreamConfig:
    """Short-lived operational events (429s per model and tier) that `tiers show` counts."""
    return StreamConfig(
        name=subjects.EVENTS_STREAM,
        subjects=[f"{subjects.EVENTS_PREFIX}.>"],
        retention=RetentionPolicy.LIMITS,
        storage=StorageType.MEMORY,
        max_age=EVENTS_MAX_AGE_S,
    )


def _durable_log(name: str, subject: str, max_age_s: float) -> StreamConfig:
    """A file-backed record stream whose publishes are deduplicated by ``Nats-Msg-Id`` for ten minutes, so a
    retried publish of the same record is stored once."""
    return StreamConfig(name=name, subjects=[subject], retention=RetentionPolicy.LIMITS, storage=StorageType.FILE,
                        max_age=max_age_s, duplicate_window=600.0)


def usage_stream_config() -> StreamConfig:
    """One usage record per finished request, for the billing writer."""
    return _durable_log(subjects.USAGE_STREAM, subjects.USAGE_SUBJECT, USAGE_MAX_AGE_S)


def batch_results_stream_config() -> StreamConfig:
    """Batch lines' outcomes, kept until the batch runner has written them to Postgres (and a while after)."""
    return _durable_log(subjects.BATCH_RESULTS_STREAM, f"{subjects.RESULT_PREFIX}.>", BATCH_RESULTS_MAX_AGE_S)


def held_writes_stream_config() -> StreamConfig:
    """Writes the gateway could not make while Postgres was away (conversation turns, responses), until it takes
    them."""
    return _durable_log(subjects.HELD_WRITES_STREAM, f"{subjects.HELD_PREFIX}.>", USAGE_MAX_AGE_S)


def dead_letter_stream_config() -> StreamConfig:
    """Records a durable writer could not write however often it tried (a value Postgres refuses, say): kept
    with the reason in their headers, so nothing is dropped silently and the writer goes on."""
    return _durable_log(subjects.DEAD_LETTER_STREAM, f"{subjects.DEAD_LETTER_PREFIX}.>", DEAD_LETTER_MAX_AGE_S)
