"""What a request is promised holds across a hand-over (issue 39's part 2), on real processes: a structured output
goes on under its grammar on the decode worker, the output filter halts a reply that turns offensive after the
prefill worker's first token, a client that leaves stops the decode worker, and each pool drains on its own: a
draining decode worker finishes the handed-over stream it holds, a draining prefill worker is offered nothing more
(long prompts then run whole).

The tenant's safety policy is the deployment's default (``block``); the tiny model's replies are random, so
``logit_bias`` makes every token " a" or "s" (tests/e2e/test_safety.py), and a reply soon spells "ass"."""

from __future__ import annotations

import json
import os
import signal

import httpx
import nats
import pytest

from switchyard.deploy.services import wait_until_ready
from switchyard.shared.jetstream import live_workers
from tests.e2e.conftest import TINY
from tests.e2e.test_disaggregation import _handovers, _nothing, sees_prefill_pool
from tests.e2e.test_kv_tiers import TIERS, long_prompt, registered
from tests.e2e.test_safety import BAD_WORD, forcing_bias
from tests.support.system import poll, stream_completion, usage_rows, worker_running

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}, "rank": {"type": "integer"}},
          "required": ["city", "rank"], "additionalProperties": False}


@pytest.fixture
async def pools(e2e, system):
    """A prefill worker and a decode worker of a model of their own, the gateway sending its long prompts apart."""
    name = "tiny-disagg-guarantees"
    workers = [e2e.start_worker(name, max_num_seqs=2, role=role, **TIERS) for role in ("prefill", "decode")]
    nc = await nats.connect(e2e.config.nats_url)
    http = httpx.AsyncClient(timeout=120)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=workers)
        by_role = {w.role: w for w in await registered(nc.jetstream(), name)}
        await sees_prefill_pool(http, system, name)
        yield name, by_role, http
    finally:
        await http.aclose()
        await nc.close()
        for worker in workers:
            worker.stop()


async def test_a_structured_output_the_output_filter_and_a_cancel_hold_across_the_hand_over(
        pools, system, auth, nats_url, database_url):
    name, by_role, http = pools
    messages = [{"role": "system", "content": long_prompt(300)}, {"role": "user", "content": "Answer in JSON."}]
    body = {"messages": messages, "max_tokens": 60, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "place", "schema": SCHEMA}}}
    r = await http.post(f"{system}/v1/chat/completions", headers=auth, json={**body, "model": name})
    assert r.status_code == 200, r.text
    assert await _handovers(http, by_role["prefill"].metrics_url) == 1
    content = r.json()["choices"][0]["message"]["content"]
    reference = await http.post(f"{system}/v1/chat/completions", headers=auth, json={**body, "model": TINY})
    # The decode worker took up the grammar where the first token left it: the reply one worker gives.
    assert content == reference.json()["choices"][0]["message"]["content"]
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert set(json.loads(content)) == {"city", "rank"}
    assert content.lstrip().startswith("{")

    forced = {"model": name, "prompt": long_prompt(300) + " Say something.", "max_tokens": 150, "temperature": 1.0,
              "seed": 3, "logit_bias": forcing_bias(), "stream": True}
    events, _ = await stream_completion(system, auth, forced, _nothing)
    assert "error" not in events[-1], events[-1]
    assert await _handovers(http, by_role["prefill"].metrics_url) == 2
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    finish = [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1]
    assert finish == "content_filter", text
    assert set(text) <= {" ", "a", "s"} and not BAD_WORD.search(text), text  # not even a part of the word

    # The client leaves mid-stream, after the hand-over: the cancel reaches the decode worker, which stops and
    # bills what it streamed.
    body = {"model": name, "prompt": long_prompt(300), "max_tokens": 3000, "ignore_eos": True, "temperature": 0,
            "stream": True}
    async with http.stream("POST", f"{system}/v1/completions", json=body, headers=auth) as resp:
        assert resp.status_code == 200
        request_id = resp.headers["x-request-id"]
        seen = 0
        async for line in resp.aiter_lines():
            seen += line.startswith("data: ") and '"text":""' not in line.replace(" ", "")
            if seen >= 5:
                break  # leaving the block closes the connection mid-stream
    # Billed once the decode worker has heard the cancel and stopped: asynchronous to the client's leaving.
    (row,) = await poll(lambda: usage_rows(database_url, nats_url, request_id,
                                           "finish_reason, completion_tokens, worker_id, prefill_worker_id"),
                        timeout_s=30, what="the cancelled stream's usage row")
    assert (row["finish_reason"], row["worker_id"], row["prefill_worker_id"]) == \
        ("cancelled", by_role["decode"].worker_id, by_role["prefill"].worker_id)
    assert 5 <= row["completion_tokens"] < 3000


async def test_each_pool_drains_on_its_own(e2e, system, auth, nats_url, database_url):
    """SIGTERM the decode worker streaming a handed-over request: the stream ends there, whole and billed once;
    SIGTERM the prefill worker: the gateway stops sending prompts apart, and a long prompt runs whole on the other
    decode worker."""
    name = "tiny-disagg-drain"
    prefill = e2e.start_worker(name, max_num_seqs=2, role="prefill", **TIERS)
    decoders = [e2e.start_worker(name, max_num_seqs=2, role="decode", drain_timeout_s=60, **TIERS)
                for _ in range(2)]
    nc = await nats.connect(nats_url)
    http = httpx.AsyncClient(timeout=120)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[prefill, *decoders])
        infos = await registered(nc.jetstream(), name, count=3)
        (prefill_info,) = [w for w in infos if w.role == "prefill"]
        await sees_prefill_pool(http, system, name)
        body = {"model": name, "prompt": long_prompt(300), "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        drained = []

        async def drain_the_decode_worker(request_id: str) -> None:
            while (worker_id := await worker_running(nc, request_id, timeout_s=10)) == prefill_info.worker_id:
                pass  # the prefill's own last delta: the decode worker's come next
            (info,) = [w for w in infos if w.worker_id == worker_id]
            drained.append(info)
            os.kill(info.pid, signal.SIGTERM)
            # At once, not at its next heartbeat, the registry says it drains: no gateway offers it anything.
            await poll(lambda: live_workers(nc.jetstream()),
                       lambda ws: any(w.worker_id == worker_id and w.draining for w in ws), timeout_s=2,
                       interval_s=0.02, what="the draining worker's beat")

        events, request_id = await stream_completion(system, auth, body, drain_the_decode_worker)
        assert drained and "error" not in events[-1], events[-1]
        assert events[-1]["usage"]["completion_tokens"] == 1000
        (row,) = await usage_rows(database_url, nats_url, request_id, "worker_id, prefill_worker_id")
        assert (row["worker_id"], row["prefill_worker_id"]) == (drained[0].worker_id, prefill_info.worker_id)
        (survivor,) = [w for w in decoders if w.pid != drained[0].pid]
        (gone,) = [w for w in decoders if w.pid == drained[0].pid]
        await poll(lambda: _running(gone), lambda running: not running, timeout_s=60,
                   what="the drained worker's exit")

        os.kill(prefill_info.pid, signal.SIGTERM)
        await poll(lambda: http.get(f"{system}/readyz"), lambda r: name not in r.json()["checks"]["prefill_pools"],
                   timeout_s=30, what="the gateway no longer sending prompts apart")
        whole = {**body, "max_tokens": 8, "stream": False}
        whole.pop("stream_options")
        r = await http.post(f"{system}/v1/completions", headers=auth, json=whole)
        assert r.status_code == 200, r.text
        survivor_id = next(w.worker_id for w in infos if w.pid == survivor.pid)
        (row,) = await usage_rows(database_url, nats_url, r.headers["X-Request-Id"], "worker_id, prefill_worker_id")
        assert (row["worker_id"], row["prefill_worker_id"]) == (survivor_id, None)
    finally:
        await http.aclose()
        await nc.close()
        for worker in [prefill, *decoders]:
            worker.stop()


async def _running(worker) -> bool:
    return worker.is_running()
