"""The billing writer's lag, as the gateway's gauges read it from JetStream: a record counts from the moment its
publish is acknowledged (not once nats-server has got round to updating the consumer), while it is delivered but
unacknowledged, and no longer once acknowledged or gone from the stream; its age is taken from when its request
ended."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import nats
import pytest

from switchyard.deploy.launcher import NatsServer
from switchyard.domain.queues import billing_lag
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_streams, ensure_usage_consumer
from switchyard.shared.messages import UsageRecord, encode


@pytest.fixture
def nats_dir():
    path = Path(tempfile.mkdtemp(prefix="switchyard-test-lag-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _record(request_id: str, ended_s_ago: float) -> bytes:
    return encode(UsageRecord(request_id=request_id, model="m", tier="pro", prompt_tokens=1, completion_tokens=1,
                              finish_reason="stop", created_at=time.time() - ended_s_ago - 0.01, queue_ms=0,
                              first_token_ms=1, total_ms=10))


async def test_a_record_counts_from_its_publish_until_its_ack(nats_dir):
    with NatsServer(nats_dir) as server:
        nc = await nats.connect(server.url)
        try:
            js = nc.jetstream(timeout=2)
            await ensure_streams(js)
            await ensure_usage_consumer(js)
            assert await billing_lag(js) == (0, 0.0)
            for i in range(20):  # each read straight after its publish's ack: never one behind
                await js.publish(subjects.USAGE_SUBJECT, _record(f"r{i}", ended_s_ago=30 - i))
                pending, age_s = await billing_lag(js)
                assert pending == i + 1 and age_s >= 29
            sub = await js.pull_subscribe_bind(subjects.USAGE_CONSUMER, subjects.USAGE_STREAM)
            msgs = await sub.fetch(5, timeout=2)
            assert (await billing_lag(js))[0] == 20  # delivered but not acked still waits to be billed
            for msg in msgs:
                await msg.ack_sync()
            pending, age_s = await billing_lag(js)
            assert pending == 15 and 20 <= age_s < 26  # the oldest left is r5, ended 25 s ago
            await js.purge_stream(subjects.USAGE_STREAM)  # records gone from the stream (aged out) wait for nobody
            assert await billing_lag(js) == (0, 0.0)
        finally:
            await nc.close()
