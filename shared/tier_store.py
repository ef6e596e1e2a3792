"""Live tier policies in the JetStream KV bucket ``tiers``, and the per-tier request streams they cap.

    KV tiers/<tier> = TierPolicy      (file storage: survives restarts; every gateway and worker reads it)
    stream REQUESTS_<TIER>            subjects llm.req.*.<tier>.*: a subject per model and tenant;
                                      max_msgs = policy.max_queued (the tier), max_msgs_per_subject =
                                      policy.tenant_cap (one tenant's queue of one model); discard new: JetStream
                                      itself refuses the 429s; max_age = an hour past the longest wait a request
                                      may be given (stream_config.request_max_age_s)

One stream per tier because JetStream caps every subject of a stream alike, and tiers need their own caps.
Readers cache for ``CACHE_S`` so a change applies everywhere within about a second without a KV read per request.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from nats.js import JetStreamContext
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from switchyard.shared import subjects
from switchyard.shared.messages import decode, encode
from switchyard.shared.single_flight import SingleFlight
from switchyard.shared.stream_config import request_max_age_s
from switchyard.shared.tiers import DEFAULT_POLICIES, TIER_NAMES, TierPolicy

TIERS_BUCKET = "tiers"
CACHE_S = 1.0

log = logging.getLogger("switchyard.tiers")


async def tiers_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    try:
        return await js.key_value(TIERS_BUCKET)
    except BucketNotFoundError:
        return await js.create_key_value(KeyValueConfig(bucket=TIERS_BUCKET, storage=StorageType.FILE, history=5,
                                                        replicas=replicas))


async def seed_policies(js: JetStreamContext, replicas: int = 1) -> None:
    """Write the default policy of every tier that has none yet (an ops change is never overwritten)."""
    kv = await tiers_bucket(js, replicas)
    for tier, policy in DEFAULT_POLICIES.items():
        try:
            await kv.create(tier, encode(policy))
        except KeyWrongLastSequenceError:
            pass  # already set, by ops or by an earlier start


async def read_policies(js: JetStreamContext) -> dict[str, TierPolicy]:
    kv = await tiers_bucket(js)
    policies = dict(DEFAULT_POLICIES)
    for tier in TIER_NAMES:
        try:
            entry = await kv.get(tier)
        except KeyNotFoundError:
            continue
        if entry.value:
            policies[tier] = decode(entry.value, TierPolicy)
    return policies


async def _queue_depths(js: JetStreamContext, tier: str) -> tuple[int, int]:
    """The tier's queued requests, and its deepest subject's (one tenant's queue of one model)."""
    info = await js.stream_info(subjects.request_stream(tier), subjects_filter=subjects.tier_subjects(tier))
    return info.state.messages, max((info.state.subjects or {}).values(), default=0)


async def apply_queue_limits(js: JetStreamContext, tier: str, policy: TierPolicy) -> tuple[int, int]:
    """Bring the tier stream's caps (the tier's, and each tenant's) to ``policy``'s without dropping queued
    requests, and raise its max age to what ``policy``'s wait needs; returns the caps set.

    JetStream enforces a lowered cap by deleting the oldest messages, which would lose accepted work. So a cap
    never goes below what is queued: while the queue is over the target, new requests are refused (it is full),
    and as it drains, `reconcile_queue_limits` lowers the cap step by step until it reaches the target. The age is
    only ever raised, for the same reason: a request accepted under a longer wait keeps the deadline it was given.
    A stream made before the age followed the policy (one hour for every tier) is raised here too.
    """
    info = await js.stream_info(subjects.request_stream(tier))
    current = tuple(v if v is not None and v >= 0 else float("inf")  # JetStream's -1: no limit
                    for v in (info.config.max_msgs, info.config.max_msgs_per_subject))
    target = (policy.max_queued, policy.tenant_cap)
    if all(t >= c for t, c in zip(target, current)):
        caps = target
    else:
        total, deepest = await _queue_depths(js, tier)
        # int() is exact: a cap of inf (no limit) is never below a depth, so min() picks a whole number.
        caps = (max(target[0], int(min(current[0], total))) if target[0] < current[0] else target[0],
                max(target[1], int(min(current[1], deepest))) if target[1] < current[1] else target[1])
    age = info.config.max_age or 0.0  # 0: no limit, which is long enough
    if age > 0.0:
        age = max(age, request_max_age_s(tier, policy))
    if caps != current or age != (info.config.max_age or 0.0):
        log.info("stream %s: caps %s, max age %.0f s", info.config.name, caps, age)
        # From the stream's own config: replicas and anything else set at creation stay as they are.
        await js.update_stream(dataclasses.replace(info.config, max_msgs=caps[0], max_msgs_per_subject=caps[1],
                                                   max_age=age))
    return caps


async def reconcile_queue_limits(js: JetStreamContext, policies: dict[str, TierPolicy]) -> None:
    """Finish lowering any cap that is still above its target, and raise any age below its policy's (run every
    second by the jobs' housekeeping)."""
    for tier in TIER_NAMES:
        await apply_queue_limits(js, tier, policies[tier])


async def write_policy(js: JetStreamContext, tier: str, policy: TierPolicy) -> None:
    """Apply ``policy`` live: the stream's caps and age at once, the rest as readers' caches expire (about a
    second)."""
    kv = await tiers_bucket(js)
    await kv.put(tier, encode(policy))
    await apply_queue_limits(js, tier, policy)


class PolicyCache:
    """Per-process view of the live policies, refreshed at most every ``CACHE_S`` seconds."""

    def __init__(self, js: JetStreamContext) -> None:
        self._js = js
        self._policies: dict[str, TierPolicy] = dict(DEFAULT_POLICIES)
        self._read_at = float("-inf")
        # Bumped by invalidate: a read begun before a change neither serves nor freshens what comes after it.
        self._generation = 0
        self._reads: SingleFlight[None] = SingleFlight()  # a burst's requests wait for one read, not one each

    def invalidate(self) -> None:
        """Read afresh next time (this process just changed a policy)."""
        self._generation += 1
        self._read_at = float("-inf")

    async def get(self) -> dict[str, TierPolicy]:
        """The policies; while NATS cannot be read (restarting, unreachable) the last ones read, so a request is
        judged by yesterday's limits rather than failed."""
        if time.monotonic() - self._read_at >= CACHE_S:
            generation = self._generation
            await self._reads.run(generation, lambda: self._read(generation))
        return self._policies

    async def _read(self, generation: int) -> None:
        try:
            policies = await read_policies(self._js)
        except Exception as exc:
            log.warning("cannot read the tier policies, keeping the last ones: %r", exc)
            policies = None
        if generation != self._generation:
            return  # changed while this read ran: what it read may predate the change
        if policies is not None:
            self._policies = policies
        self._read_at = time.monotonic()
