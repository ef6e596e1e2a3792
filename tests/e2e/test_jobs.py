"""``switchyard jobs``: the durable consumers run on their own, without a gateway."""

from __future__ import annotations

import time
import uuid

import asyncpg
import nats

from switchyard.deploy.launcher import NatsServer
from switchyard.deploy.services import ServiceProcess
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_streams
from switchyard.shared.messages import UsageRecord, encode
from tests.support.system import poll


async def test_jobs_alone_bill_usage_and_stop_on_sigterm(database_url, tmp_path):
    # A NATS of its own: on the session's, the e2e gateway's own writer could bill the record instead.
    with NatsServer(tmp_path / "nats") as server:
        jobs = ServiceProcess("jobs", ["jobs", "--nats-url", server.url, "--database-url", database_url],
                              log_path=tmp_path / "jobs.log").start()
        try:
            record = UsageRecord(request_id=uuid.uuid4().hex, model="tiny", tier="pro", prompt_tokens=5,
                                 completion_tokens=2, finish_reason="stop", created_at=time.time(), queue_ms=1.0,
                                 first_token_ms=2.0, total_ms=3.0)
            nc = await nats.connect(server.url)
            try:
                js = nc.jetstream()
                await ensure_streams(js)
                await js.publish(subjects.USAGE_SUBJECT, encode(record), headers={"Nats-Msg-Id": record.request_id})
            finally:
                await nc.close()
            conn = await asyncpg.connect(database_url)
            try:
                row = await poll(lambda: conn.fetchrow("SELECT prompt_tokens, completion_tokens FROM requests "
                                                       "WHERE request_id = $1", record.request_id),
                                 lambda r: r is not None, timeout_s=30, what=lambda _: jobs.log_tail())
            finally:
                await conn.close()
            assert (row["prompt_tokens"], row["completion_tokens"]) == (5, 2)
            assert jobs.is_running()
        finally:
            status = jobs.stop()
        assert status in (0, 130), jobs.log_tail()  # 130: stopped by the signal, through the same cleanup
