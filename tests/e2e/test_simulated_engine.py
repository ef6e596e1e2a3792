"""The simulated engine (a test double for load tests) behind a real worker, gateway, NATS and Postgres: on the
wire it must behave as the real engine does (streams with usage, n choices, stop strings, refusals, cancel frees
the seat, billing, failover to another worker without a token repeated or missing), and it must say everywhere
that it is a test double."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import asyncpg
import httpx
import nats
import pytest
from openai import AsyncOpenAI, BadRequestError

from switchyard.deploy.services import wait_until_ready
from switchyard.shared.jetstream import live_workers
from tests.support.system import poll, wait_usage_written, worker_running

SIM = "sim"
RATE = 400.0  # tokens/s per sequence: fast enough for tests, slow enough that a stream can be cancelled


@pytest.fixture(scope="module")
def sim_worker(e2e):
    worker = e2e.start_worker(SIM, max_num_seqs=64, engine="simulated", simulated_tokens_per_s=RATE)
    try:
        wait_until_ready(e2e.base_url, SIM, timeout_s=60, watch=[worker])
        yield worker
    finally:
        worker.stop()


@pytest.fixture
async def aclient(system, api_key):
    async with AsyncOpenAI(base_url=f"{system}/v1", api_key=api_key, max_retries=0, timeout=60) as client:
        yield client


async def _chat(client, content: str, **kw) -> tuple[dict[int, str], dict[int, str], object]:
    """A streamed chat: the text and finish reason of each choice, and the usage."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    stream = await client.chat.completions.create(model=SIM, messages=[{"role": "user", "content": content}],
                                                  stream=True, stream_options={"include_usage": True}, **kw)
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                reasons[choice.index] = choice.finish_reason
    return texts, reasons, usage


async def test_a_stream_has_its_tokens_its_usage_and_the_same_text_for_the_same_prompt(
        sim_worker, aclient, database_url, nats_url):
    texts, reasons, usage = await _chat(aclient, "tell me about rivers", max_tokens=12)
    assert reasons == {0: "length"} and len(texts[0].split()) == 12
    assert usage.completion_tokens == 12 and usage.prompt_tokens > 0
    again, _, _ = await _chat(aclient, "tell me about rivers", max_tokens=12)
    other, _, _ = await _chat(aclient, "tell me about mountains", max_tokens=12)
    assert again == texts and other != texts
    # Without max_tokens it stops by itself, after its configured reply length (128 by default).
    _, reasons, usage = await _chat(aclient, "and then?")
    assert reasons == {0: "stop"} and usage.completion_tokens == 128
    await wait_usage_written(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        billed = await conn.fetchval("SELECT count(*) FROM requests WHERE model = $1 AND completion_tokens = 12",
                                     SIM)
    finally:
        await conn.close()
    assert billed >= 3


async def test_n_choices_stop_strings_and_what_it_refuses(sim_worker, aclient):
    texts, reasons, usage = await _chat(aclient, "three ways", max_tokens=6, n=3)
    assert reasons == {0: "length", 1: "length", 2: "length"} and usage.completion_tokens == 18
    assert len({texts[0], texts[1], texts[2]}) == 3  # each choice its own text
    full, _, _ = await _chat(aclient, "stop somewhere", max_tokens=10)
    third = full[0].split()[2]
    cut, reasons, _ = await _chat(aclient, "stop somewhere", max_tokens=10, stop=[f" {third}"])
    assert reasons == {0: "stop"} and cut[0] == full[0][:full[0].index(f" {third}")]
    with pytest.raises(BadRequestError) as refused:
        await aclient.chat.completions.create(model=SIM, messages=[{"role": "user", "content": "x"}], logprobs=True)
    assert refused.value.body["param"] == "logprobs" and "test double" in refused.value.body["message"]


async def test_models_say_it_is_a_test_double(sim_worker, system, auth):
    async with httpx.AsyncClient(timeout=30) as http:
        models = (await http.get(f"{system}/v1/models", headers=auth)).json()["data"]
        one = (await http.get(f"{system}/v1/models/{SIM}", headers=auth)).json()
    (entry,) = [m for m in models if m["id"] == SIM]
    assert entry["engine"] == one["engine"] == "simulated" and entry["test_double"] and one["test_double"]
    assert not any(m.get("test_double") for m in models if m["id"] != SIM)
    log = sim_worker.log_tail(400)
    assert "TEST DOUBLE" in log


async def test_a_cancelled_stream_frees_its_seat(sim_worker, system, auth, nats_url):
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()

        async def running() -> int:
            return sum(sum(w.running.values()) for w in await live_workers(js) if w.model == SIM)

        async with httpx.AsyncClient(timeout=60) as http:
            body = {"model": SIM, "messages": [{"role": "user", "content": "go on and on"}], "max_tokens": 20000,
                    "stream": True}
            async with http.stream("POST", f"{system}/v1/chat/completions", json=body, headers=auth) as r:
                assert r.status_code == 200
                lines = r.aiter_lines()  # held: a dropped line iterator would be closed, and the response with it
                async for line in lines:
                    if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                        break
                await poll(running, until=lambda n: n >= 1, timeout_s=20, what="the stream running")
        await poll(running, until=lambda n: n == 0, timeout_s=20, what="the seat freed after the client left")
    finally:
        await nc.close()


async def test_a_stream_whose_worker_is_killed_goes_on_with_the_same_words(e2e, system, auth, nats_url):
    name = "sim-failover"
    workers = [e2e.start_worker(name, max_num_seqs=8, engine="simulated", simulated_tokens_per_s=50)
               for _ in range(2)]
    nc = await nats.connect(nats_url)
    try:
        wait_until_ready(system, name, timeout_s=60, watch=workers)
        js = nc.jetstream()
        await poll(lambda: live_workers(js), until=lambda ws: sum(w.model == name for w in ws) == 2,
                   timeout_s=30, what="both workers registered")
        body = {"model": name, "prompt": "once upon a time", "max_tokens": 150, "stream": True,
                "stream_options": {"include_usage": True}}
        text, killed, usage = "", [], None
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{system}/v1/completions", json=body, headers=auth) as r:
                request_id = r.headers["X-Request-Id"]
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    assert "error" not in event, event
                    usage = event.get("usage") or usage
                    if event["choices"]:
                        text += event["choices"][0]["text"]
                    if text and not killed:
                        worker_id = await worker_running(nc, request_id, timeout_s=10)
                        (info,) = [w for w in await live_workers(js) if w.worker_id == worker_id]
                        os.kill(info.pid, signal.SIGKILL)
                        killed.append(info.worker_id)
        assert killed and usage["completion_tokens"] == 150
        async with httpx.AsyncClient(timeout=60) as http:
            whole = (await http.post(f"{system}/v1/completions", headers=auth,
                                     json={**body, "stream": False, "stream_options": None})).json()
        assert text == whole["choices"][0]["text"]  # the other worker went on with the very same words
    finally:
        await nc.close()
        for worker in workers:
            worker.stop()
        await asyncio.sleep(0)
