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

import httpx
import nats
from prometheus_client.parser import text_string_to_metric_families

from switchyard.deploy.services import wait_until_ready
from tests.e2e.conftest import TINY
from tests.e2e.test_kv_tiers import BLOCK, TIERS, long_prompt, num_tokens, registered
from tests.support.system import stream_completion, usage_rows


async def _handovers(http: httpx.AsyncClient, metrics_url: str) -> float:
    r = await http.get(metrics_url)
    return sum(s.value for family in text_string_to_metric_families(r.text) for s in family.samples
               if s.name == "switchyard:request_success_total" and s.labels.get("finished_reason") == "handover")


async def _nothing(_request_id: str) -> None:
    return None


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

        (row,) = await usage_rows(database_url, nats_url, request_id, "completion_tokens, finish_reason, worker_id")
        assert (row["completion_tokens"], row["finish_reason"]) == (40, "length")
        assert row["worker_id"] == by_role["decode"].worker_id  # billed once, by the worker that finished it
    finally:
        await http.aclose()
        await nc.close()
        for worker in workers:
            worker.stop()
