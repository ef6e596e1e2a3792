"""A worker killed mid-stream, on real processes: the stream goes on on the next worker of the model to take it
(another one alive, or the dead one's replacement, or the worker itself back from a stall) with no token repeated
or missing, and is billed once; with none by the request's queue deadline, the client is told, and the tokens it got
are billed."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import asyncpg
import httpx
import nats
import pytest

from switchyard.deploy.services import wait_until_ready
from switchyard.shared import subjects
from switchyard.shared.jetstream import REQUEST_ACK_WAIT_S, ensure_request_consumer, live_workers
from tests.support.system import poll, stream_completion, worker_running


async def _usage_rows(database_url: str, request_id: str, timeout_s: float = 20.0) -> list:
    conn = await asyncpg.connect(database_url)
    try:
        return await poll(lambda: conn.fetch("SELECT prompt_tokens, completion_tokens, finish_reason, worker_id "
                                             "FROM requests "
                                             "WHERE request_id = $1", request_id),
                          timeout_s=timeout_s, what=f"the usage row of {request_id}")
    finally:
        await conn.close()


async def _streamed_whole_and_billed_once(system: str, auth: dict, database_url: str, body: dict, events: list[dict],
                                          request_id: str):
    """The stream ``events`` of ``body`` (1,500 tokens, greedy) ended whole, its text that of the same request run
    uninterrupted, and it is billed once, in full: its usage row."""
    assert "error" not in events[-1], events[-1]
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 1500
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{system}/v1/completions", headers=auth,
                            json={**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False})
    assert r.status_code == 200, r.text
    assert streamed == r.json()["choices"][0]["text"]
    (row,) = await _usage_rows(database_url, request_id)
    assert (row["completion_tokens"], row["finish_reason"]) == (1500, "length")
    return row


async def test_a_stream_whose_only_worker_is_killed_and_not_replaced_ends_with_worker_lost_and_its_tokens_are_billed(
        e2e, system, auth, database_url):
    """Its continuation waits in the queue for a worker until its deadline (the tier's wait), then the client is
    told."""
    name = "tiny-doomed"
    worker = e2e.start_worker(name, max_num_seqs=2)
    killed = False

    async def kill(_request_id: str) -> None:
        nonlocal killed
        os.kill(worker.pid, signal.SIGKILL)
        killed = True

    try:
        wait_until_ready(system, name, timeout_s=120, watch=[worker])
        body = {"model": name, "prompt": "once upon a time", "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        events, request_id = await stream_completion(system, auth, body, kill)
        assert killed and "error" in events[-1]
        assert events[-1]["error"]["code"] == "worker_lost", events[-1]
        # The tokens streamed before the worker died are billed (by the gateway, the worker being gone).
        (row,) = await _usage_rows(database_url, request_id)
        assert row["finish_reason"] == "error" and row["prompt_tokens"] > 0
        assert row["completion_tokens"] >= sum(bool(e["choices"][0]["text"]) for e in events[:-1]) > 0
    finally:
        worker.stop()


@pytest.mark.parametrize("how", ["killed", "stalled"])
async def test_a_stream_whose_only_worker_dies_goes_on_when_a_worker_is_back_exactly(
        e2e, system, auth, database_url, how):
    """``killed``: its replacement is started (as a supervisor restarts it); ``stalled``: it is stopped (SIGSTOP)
    long enough to be taken for dead, then resumes. Either way the request's continuation waits in the queue and
    the worker back takes it: the client's stream goes on with nothing repeated or missing, billed once."""
    name = f"tiny-alone-{how}"
    workers = [e2e.start_worker(name, max_num_seqs=2)]
    body = {"model": name, "prompt": "once upon a time", "max_tokens": 1500, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}

    async def fail_its_worker(_request_id: str) -> None:
        if how == "killed":
            os.kill(workers[0].pid, signal.SIGKILL)
            workers.append(e2e.start_worker(name, max_num_seqs=2))
        else:
            os.kill(workers[0].pid, signal.SIGSTOP)
            # Resumed once the gateway has given up on it (3 s) and queued the continuation.
            asyncio.get_running_loop().call_later(5.0, os.kill, workers[0].pid, signal.SIGCONT)

    try:
        wait_until_ready(system, name, timeout_s=120, watch=workers)
        events, request_id = await stream_completion(system, auth, body, fail_its_worker)
        await _streamed_whole_and_billed_once(system, auth, database_url, body, events, request_id)
        assert workers[-1].is_running()
    finally:
        for worker in workers:
            worker.stop()


@pytest.mark.parametrize("how", ["killed", "stalled"])
async def test_a_stream_whose_worker_is_killed_goes_on_on_another_worker_exactly(
        e2e, system, auth, nats_url, database_url, how):
    """``stalled``: the worker is stopped (SIGSTOP) long enough to be taken for dead, then resumes while its
    request streams from the other worker: it must stop at once, send nothing the client sees, and bill nothing."""
    name = f"tiny-failover-{how}"
    workers = [e2e.start_worker(name, max_num_seqs=2) for _ in range(2)]
    nc = await nats.connect(nats_url)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=workers)
        js = nc.jetstream()
        await poll(lambda: live_workers(js), until=lambda ws: sum(w.model == name for w in ws) == 2,
                   timeout_s=60, what="both workers registered")
        body = {"model": name, "prompt": "once upon a time", "max_tokens": 1500, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        killed: list[int] = []

        async def kill_its_worker(request_id: str) -> None:
            # Which worker runs it: the next delta says (every delta names its worker), the registry has its pid.
            worker_id = await worker_running(nc, request_id, timeout_s=10)
            (info,) = [w for w in await live_workers(js) if w.worker_id == worker_id]
            killed.append(info.worker_id)
            if how == "killed":
                os.kill(info.pid, signal.SIGKILL)
            else:
                os.kill(info.pid, signal.SIGSTOP)
                # Resumed once the gateway has given up on it (3 s) while the stream goes on elsewhere.
                asyncio.get_running_loop().call_later(4.0, os.kill, info.pid, signal.SIGCONT)

        events, request_id = await stream_completion(system, auth, body, kill_its_worker)
        assert killed
        row = await _streamed_whole_and_billed_once(system, auth, database_url, body, events, request_id)
        assert row["worker_id"] != killed[0]  # billed by the worker that finished it
        if how == "stalled":
            assert all(w.is_running() for w in workers)  # it resumed and serves on
    finally:
        await nc.close()
        for worker in workers:
            worker.stop()


async def test_a_request_pulled_by_a_worker_that_dies_before_starting_it_is_redelivered_within_seconds(
        e2e, system, auth, nats_url, database_url):
    """The worker that dies right after pulling is played by this test: it takes the request from the model's
    durable consumer, as a worker's intake does, and disconnects without acking. The real worker is frozen
    (SIGSTOP) meanwhile, so the test's pull is the one that gets it."""
    name = "tiny-redeliver"
    worker = e2e.start_worker(name, max_num_seqs=2)
    nc = await nats.connect(nats_url)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[worker])
        os.kill(worker.pid, signal.SIGSTOP)
        async with httpx.AsyncClient(timeout=60) as http:
            answer = asyncio.create_task(http.post(
                f"{system}/v1/completions", headers=auth,
                json={"model": name, "prompt": "hello", "max_tokens": 5, "temperature": 0, "ignore_eos": True}))
            js = nc.jetstream()
            conn = await asyncpg.connect(database_url)
            try:
                tenant = await conn.fetchval("SELECT id FROM tenants WHERE name = 'e2e'")
            finally:
                await conn.close()
            # The tenant's queue of the model, as the worker's intake pulls it (tenant_queues.py).
            consumer = await ensure_request_consumer(js, name, "pro", tenant)
            puller = await js.pull_subscribe_bind(consumer, stream=subjects.request_stream("pro"))
            (pulled,) = await puller.fetch(1, timeout=10)
            ack_wait = (await js.consumer_info(subjects.request_stream("pro"), consumer)).config.ack_wait
            await nc.close()  # the puller dies holding it
            os.kill(worker.pid, signal.SIGCONT)
            r = await answer
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        # Redelivered by the consumer's short ack wait (a worker marks what it holds in progress every second, so
        # a short wait never redelivers a live worker's request), not a 30 s one.
        assert ack_wait == REQUEST_ACK_WAIT_S < 10
        assert pulled.metadata.num_delivered == 1
    finally:
        os.kill(worker.pid, signal.SIGCONT)
        await nc.close()
        worker.stop()


async def test_a_worker_whose_heartbeat_entry_is_lost_serves_on_while_it_pings_and_is_gone_once_silent(
        e2e, system, auth, nats_url):
    """A cluster electing the heartbeat bucket's leader for longer than its TTL expires entries nobody could
    refresh; a restarted NATS loses the bucket. Played here by purging the worker's entry, its next heartbeat a
    minute away: its model is still served while its pings come, and answers 503 to retry once it is killed."""
    name = "tiny-unlisted"
    worker = e2e.start_worker(name, max_num_seqs=2, heartbeat_s=60)
    nc = await nats.connect(nats_url)
    body = {"model": name, "prompt": "hello", "max_tokens": 2, "temperature": 0, "ignore_eos": True}
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[worker])
        js = nc.jetstream()
        (info,) = [w for w in await live_workers(js) if w.model == name]
        await (await js.key_value(subjects.WORKERS_BUCKET)).purge(subjects.worker_key(name, info.worker_id))
        assert not [w for w in await live_workers(js) if w.model == name]
        async with httpx.AsyncClient(base_url=system, headers=auth, timeout=60) as http:
            # Longer than the gateway's cached listing (1 s) lives: each answer is from a listing without it.
            until = time.monotonic() + 2.5
            while time.monotonic() < until:
                r = await http.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text

            os.kill(worker.pid, signal.SIGKILL)

            async def attempt() -> int:  # one queued before its pings are missed waits for a worker: not this
                try:
                    r = await http.post("/v1/completions", json=body, timeout=2)
                except httpx.TimeoutException:
                    return 0
                assert r.status_code in (200, 503), r.text
                return r.status_code if r.status_code == 200 else r.json()["error"]["code"]

            await poll(attempt, lambda answer: answer == "model_unavailable", timeout_s=30, interval_s=0.5,
                       what="503 model_unavailable once the worker is silent")
    finally:
        await nc.close()
        worker.stop()
