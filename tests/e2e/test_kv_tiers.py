"""KV tiers on real processes: the workers of one host share a host tier (tmpfs block files, workers/kv_tiers/),
so what one worker computed another loads instead of computing it again.

    worker A ──(each block it caches, written through)──▶ host tier (the system's own dir) ◀──(loads)── worker B
    A killed mid-stream ──▶ the gateway continues the stream on B ──▶ B loads the prompt's (and the streamed
                           tokens') blocks from the tier instead of prefilling them again
    A stopped, A' started with the same settings ──▶ a repeated prompt: A' loads it from the tier

Seen as a user and an operator see it: the stream goes on exactly, the usage's ``cached_tokens``, and the worker's
``switchyard:kv_tier_hits`` for the host tier (its Prometheus endpoint, found in the worker registry).
"""

from __future__ import annotations

import os
import signal
import uuid

import asyncpg
import httpx
import nats
from prometheus_client.parser import text_string_to_metric_families

from switchyard.deploy.services import wait_until_ready
from switchyard.shared.config import WorkerConfig
from switchyard.shared.jetstream import live_workers
from switchyard.shared.metrics import name as metric
from tests.support.system import poll, stream_completion, worker_running

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


async def tier_samples(http: httpx.AsyncClient, metrics_url: str) -> dict[str, float]:
    """The worker's host-tier samples: name (``HITS``, ``STORES``, ...) -> value."""
    r = await http.get(metrics_url)
    assert r.status_code == 200, r.text
    return {s.name: s.value for family in text_string_to_metric_families(r.text) for s in family.samples
            if s.labels.get("kv_tier") == "host"}


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
