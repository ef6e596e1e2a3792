"""JetStream setup on a store left by an earlier layout: the old all-tiers REQUESTS stream overlaps the per-tier
streams, so an empty one is removed and one still holding requests stops the start with a clear message; a tier's
stream holds a queue for every tenant active in it, past the server's default consumer limit, and keeps a request
as long as the longest wait the tier may give it."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import msgspec
import nats
import pytest
from nats.js.api import RetentionPolicy, StreamConfig

from switchyard.deploy.launcher import NatsServer
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_request_consumer, ensure_streams
from switchyard.shared.stream_config import MAX_QUEUE_CONSUMERS
from switchyard.shared.tier_store import read_policies, reconcile_queue_limits, write_policy
from switchyard.shared.tiers import BATCH_COMPLETION_WINDOW_S, INTERACTIVE_TIERS, TIER_NAMES


@pytest.fixture
def js_url():
    path = Path(tempfile.mkdtemp(prefix="switchyard-test-js-"))
    try:
        with NatsServer(path / "nats") as server:
            yield server.url
    finally:
        shutil.rmtree(path)


async def test_an_empty_legacy_stream_makes_way_and_one_with_requests_stops_the_start(js_url):
    nc = await nats.connect(js_url)
    try:
        js = nc.jetstream()
        legacy = StreamConfig(name="REQUESTS", subjects=[f"{subjects.REQUEST_PREFIX}.>"])
        await js.add_stream(legacy)
        await js.publish(f"{subjects.REQUEST_PREFIX}.m.pro", b"old request")
        with pytest.raises(RuntimeError, match="REQUESTS.*1 queued"):
            await ensure_streams(js)

        await js.purge_stream("REQUESTS")
        await ensure_streams(js)
        names = {s.config.name for s in await js.streams_info()}
        assert "REQUESTS" not in names and subjects.request_stream("pro") in names
        await ensure_streams(js)  # and again: nothing left to do
    finally:
        await nc.close()


async def test_a_tier_stream_of_the_per_model_layout_takes_tenant_subjects_when_empty(js_url):
    nc = await nats.connect(js_url)
    try:
        js = nc.jetstream()
        stream = subjects.request_stream("pro")
        await js.add_stream(StreamConfig(name=stream, subjects=[f"{subjects.REQUEST_PREFIX}.*.pro"],
                                         retention=RetentionPolicy.WORK_QUEUE))
        await js.publish(f"{subjects.REQUEST_PREFIX}.m.pro", b"old request")
        with pytest.raises(RuntimeError, match="REQUESTS_PRO.*1 queued"):
            await ensure_streams(js)
        await js.purge_stream(stream)
        await ensure_streams(js)
        info = await js.stream_info(stream)
        assert info.config.subjects == [subjects.tier_subjects("pro")]
        assert (info.config.max_msgs, info.config.max_msgs_per_subject) == (500, 125)  # pro's tier and tenant caps
    finally:
        await nc.close()


async def test_a_tier_holds_a_queue_for_more_tenants_than_the_servers_default_consumer_limit(js_url):
    """nats-server 2.15 gives a stream without its own limit 1,000 consumers: the 1,001st tenant active in a tier
    got no consumer, and its requests waited out their deadline. A stream made by an earlier version (no limit set)
    takes today's when the gateway sets up; a worker (seed=False) may not update streams and leaves it."""
    nc = await nats.connect(js_url)
    try:
        js = nc.jetstream()
        stream = subjects.request_stream("pro")
        await ensure_streams(js)
        earlier = (await js.stream_info(stream)).config
        earlier.max_consumers = -1
        await js.update_stream(earlier)
        await ensure_streams(js, seed=False)
        assert (await js.stream_info(stream)).config.max_consumers == -1
        await ensure_streams(js)
        assert (await js.stream_info(stream)).config.max_consumers == MAX_QUEUE_CONSUMERS
        assert (await js.stream_info(subjects.AFFINITY_STREAM)).config.max_consumers == MAX_QUEUE_CONSUMERS

        tenants = [f"tenant-{i}" for i in range(1_010)]
        for tenant in tenants:
            await ensure_request_consumer(js, "m", "pro", tenant)
        last = tenants[-1]
        await js.publish(subjects.request_subject("m", "pro", last), b"the last tenant's request")
        sub = await js.pull_subscribe_bind(subjects.request_consumer("m", "pro", last), stream=stream)
        [msg] = await sub.fetch(1, timeout=5)
        assert msg.data == b"the last tenant's request"
        assert (await js.stream_info(stream)).state.consumer_count == len(tenants)
    finally:
        await nc.close()


async def test_a_queued_request_outlives_the_longest_wait_its_tier_may_give_it(js_url):
    """A queued request is answered by its deadline (queue_timeout), never dropped by the stream before it: a batch
    line may wait its batch's whole 24-hour window (a two-hour soak lost lines to a one-hour age). A stream made by
    an earlier version (one hour everywhere) is raised when the gateway sets up; a longer wait set live raises its
    tier's age at once; a shorter one never lowers it (requests already queued keep the wait they were given)."""
    nc = await nats.connect(js_url)
    try:
        js = nc.jetstream()
        await ensure_streams(js)
        ages = {tier: (await js.stream_info(subjects.request_stream(tier))).config.max_age for tier in TIER_NAMES}
        policies = await read_policies(js)
        assert ages["batch"] >= BATCH_COMPLETION_WINDOW_S + 3600
        for tier in INTERACTIVE_TIERS:
            assert ages[tier] >= policies[tier].max_wait_s + 3600

        stream = subjects.request_stream("batch")
        earlier = (await js.stream_info(stream)).config
        earlier.max_age = 3600.0
        await js.update_stream(earlier)
        await js.publish(subjects.request_subject("m", "batch", "t"), b"a line queued under the old age")
        await ensure_streams(js)
        info = await js.stream_info(stream)
        assert (info.config.max_age, info.state.messages) == (ages["batch"], 1)

        pro = subjects.request_stream("pro")
        await write_policy(js, "pro", msgspec.structs.replace(policies["pro"], max_wait_s=2 * 3600.0))
        assert (await js.stream_info(pro)).config.max_age == 3 * 3600.0
        await write_policy(js, "pro", policies["pro"])
        await reconcile_queue_limits(js, await read_policies(js))
        assert (await js.stream_info(pro)).config.max_age == 3 * 3600.0
    finally:
        await nc.close()
