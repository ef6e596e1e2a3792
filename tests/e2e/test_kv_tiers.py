"""KV tiers on real processes: the workers of one host share a host tier (tmpfs block files, workers/kv_tiers/),
so what one worker computed another loads instead of computing it again.

    worker A ──(each block it caches, written through)──▶ host tier (the system's own dir) ◀──(loads)── worker B
    A killed mid-stream ──▶ the gateway continues the stream on B ──▶ B loads the prompt's (and the streamed
                           tokens') blocks from the tier instead of prefilling them again
    A stopped, A' started with the same settings ──▶ a repeated prompt: A' loads it from the tier
    A and B on two nodes (a host tier each), A busy ──▶ a turn of A's conversation runs on B, which fetches its
                           history's blocks from A's node over NATS (workers/service/kv_blocks.py) instead of
                           computing them

Seen as a user and an operator see it: the stream goes on exactly, the usage's ``cached_tokens``, and the worker's
``switchyard:kv_tier_hits`` for the host tier (its Prometheus endpoint, found in the worker registry).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid

import asyncpg
import httpx
import msgspec
import nats
from prometheus_client.parser import text_string_to_metric_families

from switchyard.deploy.services import wait_until_ready
from switchyard.deploy.system import LocalSystem
from switchyard.shared import subjects
from switchyard.shared.config import WorkerConfig
from switchyard.shared.jetstream import live_workers
from switchyard.shared.kv_events import KVEventBatch, events_subject
from switchyard.shared.metrics import name as metric
from tests.support.system import free_port, poll, stream_completion, worker_running
from tests.support.tiny_model import save_tiny_model

TIERS = {"kv_offload_gib": 0.25}  # the host tier: the system's own directory (LocalSystem._host_tier_dir)
BLOCK = WorkerConfig().block_size
HITS, STORES = metric("kv_tier_hits_total"), metric("kv_tier_stores_total")  # the samples of two counters


def long_prompt(words: int = 150) -> str:
    """A prompt of several hundred tokens (the tiny model's byte-level tokenizer: about 4 a word), unique to this
    run, so no block of it is in the tier before the test computes it."""
    head = f"Record {uuid.uuid4().hex}."
    return " ".join([head, *(f"line {i} of the ledger says {i * 7919 % 1000}" for i in range(words // 6))])


def num_tokens(e2e, prompt: str) -> int:
    """The prompt's token count as the workers count it (the completions endpoint sends the text as is)."""
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(e2e.work / "tiny-model").encode(prompt, verbose=False))


async def tier_samples(http: httpx.AsyncClient, metrics_url: str, tier: str = "host") -> dict[str, float]:
    """The worker's samples of one KV tier: name (``HITS``, ``STORES``, ...) -> value."""
    r = await http.get(metrics_url)
    assert r.status_code == 200, r.text
    return {s.name: s.value for family in text_string_to_metric_families(r.text) for s in family.samples
            if s.labels.get("kv_tier") == tier}


async def registered(js, name: str, count: int = 2) -> list:
    """The workers of ``name`` in the registry, once there are ``count`` of them."""
    async def of_name() -> list:
        return [w for w in await live_workers(js) if w.model == name]

    return await poll(of_name, until=lambda ws: len(ws) == count, timeout_s=60,
                      what=f"{count} workers of {name} registered")


async def test_a_stream_whose_worker_is_killed_goes_on_on_another_worker_that_loads_its_blocks_from_the_host_tier(
        e2e, system, auth, nats_url, database_url):
    name = "tiny-kv-failover"
    workers = [e2e.start_worker(name, max_num_seqs=2, **TIERS) for _ in range(2)]
    nc = await nats.connect(nats_url)
    http = httpx.AsyncClient(timeout=60)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=workers)
        js = nc.jetstream()
        await registered(js, name)
        prompt = long_prompt()
        prompt_tokens = num_tokens(e2e, prompt)
        assert prompt_tokens >= 400, prompt_tokens
        body = {"model": name, "prompt": prompt, "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        killed = []

        async def kill_its_worker(request_id: str) -> None:
            worker_id = await worker_running(nc, request_id, timeout_s=10)
            (info,) = [w for w in await live_workers(js) if w.worker_id == worker_id]
            # Its prompt's blocks are in the host tier (written off the step, so a moment after the first token):
            # the operator's view of it is the worker's own store counter.
            await poll(lambda: tier_samples(http, info.metrics_url),
                       until=lambda s: s.get(STORES, 0) >= prompt_tokens // BLOCK,
                       timeout_s=10, what=lambda s: f"the prompt's blocks written to the host tier: {s}")
            killed.append(info)
            os.kill(info.pid, signal.SIGKILL)

        events, request_id = await stream_completion(system, auth, body, kill_its_worker)
        assert killed and "error" not in events[-1], events[-1]
        streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        usage = events[-1]["usage"]
        assert usage["completion_tokens"] == 1500 and usage["prompt_tokens"] == prompt_tokens

        # The continuation loaded the dead worker's blocks: the survivor read them from the host tier, and the
        # usage counts the prompt's full blocks as cached, or the whole prompt where the blocks loaded run on into
        # the tokens streamed before the kill (those are completion tokens, never counted as cached).
        (survivor,) = [w for w in await live_workers(js) if w.model == name and w.worker_id != killed[0].worker_id]
        tiers = await tier_samples(http, survivor.metrics_url)
        assert tiers[HITS] >= prompt_tokens // BLOCK, tiers
        assert prompt_tokens // BLOCK * BLOCK <= usage["prompt_tokens_details"]["cached_tokens"] <= prompt_tokens, usage

        # The same request on the survivor, uninterrupted: the continued stream is identical to it.
        r = await http.post(f"{system}/v1/completions", headers=auth,
                            json={**{k: v for k, v in body.items() if k != "stream_options"}, "stream": False},
                            timeout=120)
        assert r.status_code == 200, r.text
        assert streamed == r.json()["choices"][0]["text"]
        conn = await asyncpg.connect(database_url)
        try:
            (row,) = await poll(lambda: conn.fetch("SELECT completion_tokens, finish_reason, worker_id FROM requests "
                                                   "WHERE request_id = $1", request_id),
                                timeout_s=20, what=f"the usage row of {request_id}")
        finally:
            await conn.close()
        assert (row["completion_tokens"], row["finish_reason"]) == (1500, "length")
        assert row["worker_id"] == survivor.worker_id  # billed once, by the worker that finished it
    finally:
        await http.aclose()
        await nc.close()
        for worker in workers:
            worker.stop()


async def test_a_restarted_worker_answers_a_repeated_prompt_from_the_host_tier(e2e, system, auth, nats_url):
    name = "tiny-kv-restart"
    prompt = long_prompt()
    prompt_tokens = num_tokens(e2e, prompt)
    body = {"model": name, "prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    nc = await nats.connect(nats_url)
    http = httpx.AsyncClient(timeout=120)
    worker = e2e.start_worker(name, max_num_seqs=2, **TIERS)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[worker])
        first = await http.post(f"{system}/v1/completions", headers=auth, json=body)
        assert first.status_code == 200, first.text
        assert first.json()["usage"]["prompt_tokens"] == prompt_tokens
        assert first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        worker.stop()  # SIGTERM: it finishes its writes to the tier and exits

        worker = e2e.start_worker(name, max_num_seqs=2, **TIERS)  # the same settings: the system's host tier
        wait_until_ready(system, name, timeout_s=120, watch=[worker])
        (info,) = await registered(nc.jetstream(), name, count=1)
        assert info.pid == worker.pid
        again = await http.post(f"{system}/v1/completions", headers=auth, json=body)
        assert again.status_code == 200, again.text
        # Its pool is new and empty: every cached token came from the host tier.
        assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == (prompt_tokens - 1) // BLOCK * BLOCK
        assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
        tiers = await tier_samples(http, info.metrics_url)
        assert tiers[HITS] >= (prompt_tokens - 1) // BLOCK, tiers
    finally:
        await http.aclose()
        await nc.close()
        worker.stop()


async def test_a_turn_whose_holder_is_busy_fetches_its_history_from_the_holders_node(e2e, auth, nats_url,
                                                                                     database_url, tmp_path):
    """Two nodes (each worker a host tier of its own), one seat each. A conversation's first turn runs on one, a
    long follow-up takes that worker's seat, and a short follow-up then runs on the other worker: the gateway's
    index names the first worker's node as holding the history (``kv_source``), and the other worker fetches those
    blocks from it rather than computing them, with the tokens a recompute would give."""
    model = "tiny-kv-nodes"
    # A context long enough that the long turn ends only when released: its 60,000 tokens outlast the short turn
    # however loaded the machine (3,000 did not always, and then the short turn ran on the freed holder).
    weights = save_tiny_model(tmp_path / "tiny-long", max_context=1 << 16)
    workers = [LocalSystem.start_worker(e2e, f"worker-{model}-{i}", model=str(weights), served_model_name=model,
                                        max_num_seqs=1, kv_offload_host_dir=tmp_path / f"node-{i}", **TIERS)
               for i in range(2)]
    # A gateway of its own whose offers outlast a loaded machine's slowest pull, so the long turn surely runs where
    # the first did (as in test_affinity.py): this test is about what the other worker does.
    port = free_port()
    gateway = e2e.start_gateway("gateway-kv-nodes", port=port, affinity_wait_s=10.0)
    system = e2e.url(port)
    nc = await nats.connect(nats_url)
    http = httpx.AsyncClient(timeout=120, headers=auth)
    try:
        wait_until_ready(system, model, timeout_s=120, watch=[*workers, gateway])
        infos = {w.worker_id: w for w in await registered(nc.jetstream(), model)}
        history = [{"role": "system", "content": long_prompt()}, {"role": "user", "content": "first"}]

        async def chat(messages: list[dict], max_tokens: int = 8) -> dict:
            r = await http.post(f"{system}/v1/chat/completions", json={
                "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        loads: dict[str, float] = {}  # each worker's load as its last KV event batch said (the gateway's index too)

        async def heard(msg) -> None:
            batch = msgspec.msgpack.decode(msg.data, type=KVEventBatch)
            loads[batch.worker_id] = batch.load

        await nc.subscribe(events_subject(subjects.model_token(model)), cb=heard)
        first = await chat(history)
        history.append(first["choices"][0]["message"])
        # The index skips a worker whose seats it last heard were all taken: the long turn goes out once both
        # workers have said they are idle again, or it could find the holder still busy with the first turn.
        async def seen() -> dict[str, float]:
            return dict(loads)

        await poll(seen, until=lambda now: len(now) == 2 and not any(now.values()), timeout_s=30,
                   what="both workers idle in their KV events")
        busy, release = asyncio.Event(), asyncio.Event()

        async def long_turn() -> str:
            body = {"model": model, "messages": [*history, {"role": "user", "content": "long"}],
                    "max_tokens": 60_000, "temperature": 0, "ignore_eos": True, "stream": True}
            async with http.stream("POST", f"{system}/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():  # read on: a client that stops reading goes away
                    if '"content":"' in line:
                        busy.set()
                    if release.is_set():
                        break
                return r.headers["X-Request-Id"]

        hog = asyncio.create_task(long_turn())
        await asyncio.wait_for(busy.wait(), 60)
        short = [*history, {"role": "user", "content": "short"}]
        other = await chat(short)
        assert not hog.done(), "the short turn did not wait for the long one"
        release.set()
        hog_id = await hog
        ids = [first["id"].removeprefix("chatcmpl-"), hog_id, other["id"].removeprefix("chatcmpl-")]
        conn = await asyncpg.connect(database_url)
        try:
            rows = await poll(lambda: conn.fetch("SELECT request_id, worker_id FROM requests "
                                                 "WHERE request_id = any($1::text[])", ids),
                              until=lambda rows: len(rows) == 3, timeout_s=30, what="the usage rows")
        finally:
            await conn.close()
        served = {r["request_id"]: r["worker_id"] for r in rows}
        holder, fetcher = served[ids[0]], served[ids[2]]
        assert served[hog_id] == holder and fetcher not in (None, holder), served

        # The short turn's history came from the holder's node: the whole first turn's blocks, and counted as
        # cached though the worker that ran it had never seen the conversation.
        first_prompt = first["usage"]["prompt_tokens"]
        assert other["usage"]["prompt_tokens_details"]["cached_tokens"] >= first_prompt // BLOCK * BLOCK - BLOCK
        remote = await tier_samples(http, infos[fetcher].metrics_url, "remote")
        assert remote[HITS] >= first_prompt // BLOCK - 1, remote
        # The same turn again on the fetcher, from its own tiers now: the same tokens as the fetched run gave.
        again = await chat(short)
        assert again["choices"][0]["message"]["content"] == other["choices"][0]["message"]["content"]
    finally:
        await http.aclose()
        await nc.close()
        gateway.stop()
        for worker in workers:
            worker.stop()
