"""Disaggregated serving on real processes: a prefill worker and a decode worker of one model, sharing the host's
KV tier. A long prompt is prefilled by the prefill worker, which streams the first token and hands the request
over; the decode worker goes on from it with the prompt's blocks loaded from the tier, not computed again.

    client ─▶ gateway ─▶ llm.req.<model>~prefill ─▶ prefill worker: prompt + first token ─▶ host tier (blocks)
                 ▲  handover (finish_reason "handover", never the client's) ◀───────┘
                 └─▶ llm.req.<model> (a continuation) ─▶ decode worker: loads the blocks, streams the rest, bills

Seen as a user and an operator see it: one stream, exactly the text one worker gives, one usage row (the decode
worker's, every token billed once), the prompt counted as cached, and the prefill worker's hand-over counted.
"""

from __future__ import annotations

import asyncio
import os
import signal

import httpx
import nats
from prometheus_client.parser import text_string_to_metric_families

from switchyard.deploy.services import wait_until_ready
from tests.e2e.conftest import TINY
from tests.e2e.test_kv_tiers import BLOCK, HITS, TIERS, long_prompt, num_tokens, registered, tier_samples
from tests.e2e.test_metrics import scrape
from tests.support.system import free_port, poll, stream_completion, usage_rows, worker_running


async def _handovers(http: httpx.AsyncClient, metrics_url: str) -> float:
    r = await http.get(metrics_url)
    return sum(s.value for family in text_string_to_metric_families(r.text) for s in family.samples
               if s.name == "switchyard:request_success_total" and s.labels.get("finished_reason") == "handover")


async def _nothing(_request_id: str) -> None:
    return None


async def sees_prefill_pool(http: httpx.AsyncClient, system: str, name: str) -> None:
    """Until the gateway sends ``name``'s long prompts apart: its /readyz lists the prefill pool it sees (its view
    of the worker registry may be a second behind NATS's)."""
    await poll(lambda: http.get(f"{system}/readyz"), lambda r: name in r.json()["checks"]["prefill_pools"],
               timeout_s=30, what=f"the gateway seeing {name}'s prefill pool")


async def test_a_long_prompt_is_prefilled_on_the_prefill_worker_and_decoded_on_the_decode_worker(
        e2e, system, auth, nats_url, database_url):
    name = "tiny-disagg"
    workers = [e2e.start_worker(name, max_num_seqs=2, role=role, **TIERS) for role in ("prefill", "decode")]
    nc = await nats.connect(nats_url)
    http = httpx.AsyncClient(timeout=60)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=workers)
        by_role = {w.role: w for w in await registered(nc.jetstream(), name)}
        assert set(by_role) == {"prefill", "decode"}
        await sees_prefill_pool(http, system, name)
        prompt = long_prompt(300)
        prompt_tokens = num_tokens(e2e, prompt)
        assert len(prompt) // 4 >= e2e.config.gateway.prefill_min_prompt_tokens  # long enough to go apart
        body = {"model": name, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        events, request_id = await stream_completion(system, auth, body, _nothing)
        assert "error" not in events[-1], events[-1]
        streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert [e["choices"][0]["finish_reason"] for e in events if e["choices"]][-1] == "length"
        usage = events[-1]["usage"]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (prompt_tokens, 40)
        # The decode worker never saw the prompt: its full blocks came from the tier, as the prefill left them.
        assert usage["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens // BLOCK * BLOCK, usage
        assert await _handovers(http, by_role["prefill"].metrics_url) == 1

        # One worker (the deployment's own, the same weights) gives exactly this text.
        r = await http.post(f"{system}/v1/completions", headers=auth, timeout=120, json={
            **{k: v for k, v in body.items() if k != "stream_options"}, "model": TINY, "stream": False})
        assert r.status_code == 200, r.text
        assert streamed == r.json()["choices"][0]["text"]

        (row,) = await usage_rows(database_url, nats_url, request_id,
                                  "completion_tokens, finish_reason, worker_id, prefill_worker_id, kv_loaded_bytes")
        assert (row["completion_tokens"], row["finish_reason"]) == (40, "length")
        # Billed once, by the worker that finished it, naming the one that prefilled it and the KV that moved: the
        # prompt's full blocks, every one the same size.
        assert (row["worker_id"], row["prefill_worker_id"]) == (by_role["decode"].worker_id,
                                                                by_role["prefill"].worker_id)
        assert row["kv_loaded_bytes"] > 0 and row["kv_loaded_bytes"] % (prompt_tokens // BLOCK) == 0, dict(row)
        (whole,) = await usage_rows(database_url, nats_url, r.headers["X-Request-Id"],
                                    "prefill_worker_id, kv_loaded_bytes")
        assert (whole["prefill_worker_id"], whole["kv_loaded_bytes"]) == (None, 0)

        # The gateway gauges the prefill pool's queue as a model of its own: what KEDA scales that pool on.
        def prefill_queue_gauged(samples: dict) -> bool:
            return any(metric == "switchyard:queue_depth" and ("model", f"{name}~prefill") in labels
                       for metric, labels in samples)
        await poll(lambda: scrape(http, f"{system}/metrics", headers=auth), prefill_queue_gauged, timeout_s=30,
                   what="the prefill queue's depth gauge")

        # A prompt under the threshold is not worth a hand-over: the decode worker prefills it itself.
        short = "Say something."
        assert len(short) // 4 < e2e.config.gateway.prefill_min_prompt_tokens
        r = await http.post(f"{system}/v1/completions", headers=auth, timeout=120, json={
            "model": name, "prompt": short, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        (row,) = await usage_rows(database_url, nats_url, r.headers["X-Request-Id"], "worker_id, prefill_worker_id")
        assert (row["worker_id"], row["prefill_worker_id"]) == (by_role["decode"].worker_id, None)
        assert await _handovers(http, by_role["prefill"].metrics_url) == 1
    finally:
        await http.aclose()
        await nc.close()
        for worker in workers:
            worker.stop()


async def test_a_decode_worker_killed_mid_stream_is_replaced_by_another_and_a_dead_prefill_pool_by_whole_requests(
        e2e, system, auth, nats_url, database_url):
    """Faults on either side of the hand-over: the decode worker running a handed-over request is SIGKILLed
    mid-stream, and the stream goes on exactly on the other decode worker (billed once, by it); then the prefill
    worker is SIGKILLed, and a long prompt sent at once, while the registry still lists it, waits out the prefill
    offer and runs whole on a decode worker."""
    name = "tiny-disagg-faults"
    prefill = e2e.start_worker(name, max_num_seqs=2, role="prefill", **TIERS)
    decoders = [e2e.start_worker(name, max_num_seqs=2, role="decode", **TIERS) for _ in range(2)]
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    http = httpx.AsyncClient(timeout=60)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[prefill, *decoders])
        infos = await registered(js, name, count=3)
        (prefill_info,) = [w for w in infos if w.role == "prefill"]
        await sees_prefill_pool(http, system, name)  # else the first prompt may run whole (a second-old view)
        body = {"model": name, "prompt": long_prompt(300), "max_tokens": 1000, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        killed = []

        async def kill_the_decode_worker(request_id: str) -> None:
            while (worker_id := await worker_running(nc, request_id, timeout_s=10)) == prefill_info.worker_id:
                pass  # the prefill's own last delta: the decode worker's come next
            (info,) = [w for w in infos if w.worker_id == worker_id]
            assert info.role == "decode"
            killed.append(info)
            os.kill(info.pid, signal.SIGKILL)

        events, request_id = await stream_completion(system, auth, body, kill_the_decode_worker)
        assert killed and "error" not in events[-1], events[-1]
        streamed = "".join(e["choices"][0]["text"] for e in events if e["choices"])
        assert events[-1]["usage"]["completion_tokens"] == 1000
        reference = await http.post(f"{system}/v1/completions", headers=auth, timeout=120, json={
            **{k: v for k, v in body.items() if k != "stream_options"}, "model": TINY, "stream": False})
        assert streamed == reference.json()["choices"][0]["text"]
        (survivor,) = [w for w in infos if w.role == "decode" and w.worker_id != killed[0].worker_id]
        (row,) = await usage_rows(database_url, nats_url, request_id, "completion_tokens, worker_id, prefill_worker_id")
        assert (row["completion_tokens"], row["worker_id"], row["prefill_worker_id"]) == \
            (1000, survivor.worker_id, prefill_info.worker_id)

        os.kill(prefill_info.pid, signal.SIGKILL)
        short = {**body, "max_tokens": 8, "stream": False}
        short.pop("stream_options")
        r = await http.post(f"{system}/v1/completions", headers=auth, json=short, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["finish_reason"] == "length"
        (row,) = await usage_rows(database_url, nats_url, r.headers["X-Request-Id"], "completion_tokens, worker_id")
        assert (row["completion_tokens"], row["worker_id"]) == (8, survivor.worker_id)
    finally:
        await http.aclose()
        await nc.close()
        for worker in [prefill, *decoders]:
            worker.stop()


async def test_a_decode_worker_on_another_node_fetches_the_prefills_blocks_from_its_node(e2e, system, auth,
                                                                                          nats_url, tmp_path):
    """The prefill worker and the decode worker on two nodes (a host tier each): the gateway's KV index names the
    prefill worker's node in the hand-over (``kv_source``), and the decode worker fetches the prompt's blocks from
    it over NATS (workers/service/kv_blocks.py) instead of computing them, with the text one worker gives."""
    name = "tiny-disagg-nodes"
    workers = [e2e.start_worker(name, max_num_seqs=2, role=role, kv_offload_host_dir=tmp_path / f"node-{role}",
                                **TIERS) for role in ("prefill", "decode")]
    nc = await nats.connect(nats_url)
    http = httpx.AsyncClient(timeout=120, headers=auth)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=workers)
        by_role = {w.role: w for w in await registered(nc.jetstream(), name)}
        await sees_prefill_pool(http, system, name)
        messages = [{"role": "system", "content": long_prompt(300)}, {"role": "user", "content": "Go on."}]
        body = {"messages": messages, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        r = await http.post(f"{system}/v1/chat/completions", json={**body, "model": name})
        assert r.status_code == 200, r.text
        reply = r.json()
        prompt_tokens = reply["usage"]["prompt_tokens"]
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] >= prompt_tokens // BLOCK * BLOCK - BLOCK
        assert await _handovers(http, by_role["prefill"].metrics_url) == 1
        remote = await tier_samples(http, by_role["decode"].metrics_url, "remote")
        assert remote[HITS] >= prompt_tokens // BLOCK - 1, remote
        reference = await http.post(f"{system}/v1/chat/completions", json={**body, "model": TINY})
        assert reply["choices"][0]["message"]["content"] == reference.json()["choices"][0]["message"]["content"]
    finally:
        await http.aclose()
        await nc.close()
        for worker in workers:
            worker.stop()


async def test_a_prefill_offer_that_falls_back_while_the_prefill_runs_is_answered_once_and_billed_once(
        e2e, auth, nats_url, database_url):
    """A gateway whose prefill offers last less than a prefill worker's step: the fallback copy goes to the decode
    worker while the prefill worker runs the offer too. Whichever the gateway follows, the run of the attempt it
    moved on from stops unbilled: every reply is exact, and every request has one usage row."""
    name = "tiny-disagg-race"
    workers = [e2e.start_worker(name, max_num_seqs=4, role=role, **TIERS) for role in ("prefill", "decode")]
    port = free_port()
    gateway = e2e.start_gateway("gateway-disagg-race", port=port, prefill_wait_s=0.2)
    system = e2e.url(port)
    nc = await nats.connect(nats_url)
    http = httpx.AsyncClient(timeout=120, headers=auth)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[*workers, gateway])
        await registered(nc.jetstream(), name)
        prompts = [long_prompt(300) for _ in range(4)]

        async def complete(model: str, prompt: str) -> httpx.Response:
            r = await http.post(f"{system}/v1/completions", json={
                "model": model, "prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r

        replies = await asyncio.gather(*(complete(name, p) for p in prompts))
        for prompt, r in zip(prompts, replies):
            reference = await complete(TINY, prompt)
            assert r.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
            rows = await usage_rows(database_url, nats_url, r.headers["X-Request-Id"], "completion_tokens")
            assert [row["completion_tokens"] for row in rows] == [24]
    finally:
        await http.aclose()
        await nc.close()
        gateway.stop()
        for worker in workers:
            worker.stop()
