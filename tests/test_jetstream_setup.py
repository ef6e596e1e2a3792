"""JetStream setup on a store left by an earlier layout: the old all-tiers REQUESTS stream overlaps the per-tier
streams, so an empty one is removed and one still holding requests stops the start with a clear message."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import nats
import pytest
from nats.js.api import RetentionPolicy, StreamConfig

from switchyard.deploy.launcher import NatsServer
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_streams


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
