"""SIGTERM is a graceful stop, on real processes: a gateway reports not-ready and finishes its open streams, a
worker stops pulling, keeps its heartbeat and finishes its running requests; only then do they exit."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import httpx
import nats

from switchyard.deploy.services import wait_until_ready
from switchyard.shared import subjects
from switchyard.shared.jetstream import live_workers, workers_bucket
from tests.support.system import free_port, poll

MODEL = "tiny"


async def _stream(http: httpx.AsyncClient, url: str, auth: dict, model: str, max_tokens: int, started: asyncio.Event):
    """Stream a completion; returns (number of content chunks, finish reason, saw [DONE])."""
    body = {"model": model, "prompt": "once upon a time", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    chunks, finish, done = 0, None, False
    async with http.stream("POST", f"{url}/v1/completions", json=body, headers=auth) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            choice = event["choices"][0]
            chunks += bool(choice["text"])
            finish = choice["finish_reason"] or finish
            started.set()
    return chunks, finish, done


async def _sigterm_mid_stream(http: httpx.AsyncClient, url: str, auth: dict, model: str, max_tokens: int,
                              pid: int) -> asyncio.Task:
    """Start a stream, SIGTERM ``pid`` once its first chunk is in; returns the stream's task."""
    started = asyncio.Event()
    stream = asyncio.create_task(_stream(http, url, auth, model, max_tokens, started))
    await asyncio.wait_for(started.wait(), 30)
    os.kill(pid, signal.SIGTERM)
    return stream


async def _exited(pid_alive, timeout_s: float) -> None:
    await poll(lambda: asyncio.sleep(0, not pid_alive()), timeout_s=timeout_s, what="the process to exit")


async def test_a_gateway_on_sigterm_reports_not_ready_finishes_its_stream_then_exits(e2e, auth):
    port = free_port()
    gw = e2e.start_gateway("gateway-drain", port=port, drain_timeout_s=60)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(url, MODEL, timeout_s=60, watch=[gw])
        async with httpx.AsyncClient(timeout=60) as http:
            stream = await _sigterm_mid_stream(http, url, auth, MODEL, 1500, gw.pid)
            ready = await poll(lambda: http.get(f"{url}/readyz"), lambda r: r.status_code == 503, timeout_s=10,
                               what="/readyz to answer 503")
            assert ready.json()["checks"]["draining"] is True
            assert not stream.done(), "the stream must still be running while the gateway drains"
            chunks, finish, done = await stream
        assert (finish, done) == ("length", True) and chunks > 0
        await _exited(gw.is_running, 30)
    finally:
        gw.stop()


async def _heartbeat_revision(nats_url: str, model: str) -> int:
    """The KV revision of ``model``'s one worker entry: every heartbeat writes a new one."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        (worker,) = [w for w in await live_workers(js) if w.model == model]
        kv = await workers_bucket(js)
        return (await kv.get(subjects.worker_key(model, worker.worker_id))).revision
    finally:
        await nc.close()


async def test_a_worker_on_sigterm_keeps_its_heartbeat_and_finishes_its_request(e2e, system, auth, nats_url):
    name = "tiny-drain"
    # Beats every 0.2 s: several fall within the request's run, however fast the machine generates.
    # Its drain waits for the request however slow the machine (the default 60 s would end a long one early).
    worker = e2e.start_worker(name, max_num_seqs=2, heartbeat_s=0.2, drain_timeout_s=600)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[worker])
        async with httpx.AsyncClient(timeout=60) as http:
            stream = await _sigterm_mid_stream(http, system, auth, name, 4000, worker.pid)
            before = await _heartbeat_revision(nats_url, name)
            # A beat after the signal, while the request still runs: the model does not read as gone.
            await poll(lambda: _heartbeat_revision(nats_url, name), lambda rev: rev > before, timeout_s=10,
                       what="a heartbeat during the drain")
            assert not stream.done() and worker.is_running()
            chunks, finish, done = await stream
        assert (finish, done) == ("length", True) and chunks > 0
        await _exited(worker.is_running, 30)
    finally:
        worker.stop()


async def _status_url(nats_url: str, model: str) -> str:
    """The base URL of ``model``'s one worker's HTTP port, from the worker registry."""
    nc = await nats.connect(nats_url)
    try:
        (worker,) = [w for w in await live_workers(nc.jetstream()) if w.model == model]
    finally:
        await nc.close()
    return worker.metrics_url.removesuffix("/metrics")


async def test_a_worker_drained_over_http_answers_once_its_request_finished(e2e, system, auth, nats_url):
    """Kubernetes' preStop hook: GET /drain stops the worker pulling (not ready) and answers only once its running
    request has finished; the worker then exits by itself."""
    name = "tiny-http-drain"
    # Its drain waits for the request however slow the machine (under a loaded run the default 60 s ended the
    # 4,000-token stream with worker_shutdown before it finished).
    worker = e2e.start_worker(name, max_num_seqs=2, drain_timeout_s=600)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[worker])
        status = await _status_url(nats_url, name)
        async with httpx.AsyncClient(timeout=600) as http:
            assert (await http.get(f"{status}/healthz")).status_code == 200
            assert (await http.get(f"{status}/readyz")).status_code == 200
            started = asyncio.Event()
            stream = asyncio.create_task(_stream(http, system, auth, name, 4000, started))
            await asyncio.wait_for(started.wait(), 30)
            drain = asyncio.create_task(http.get(f"{status}/drain"))
            await poll(lambda: http.get(f"{status}/readyz"), lambda r: r.status_code == 503, timeout_s=10,
                       what="the worker's /readyz to answer 503")
            assert not stream.done() and not drain.done()
            chunks, finish, done = await stream
            answer = await drain
        assert (finish, done) == ("length", True) and chunks > 0
        assert (answer.status_code, answer.text) == (200, "drained\n")
        await _exited(worker.is_running, 30)
    finally:
        worker.stop()
