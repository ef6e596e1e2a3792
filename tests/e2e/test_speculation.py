"""A worker started with speculative decoding (`--speculative ngram`, or `--speculative draft` with the tiny model
drafting for itself), on real processes: its greedy outputs are the ones a worker without it gives, its usage counts
the tokens its client got, and its metrics say how many drafts it computed and kept."""

from __future__ import annotations

import httpx
import nats
import pytest

from switchyard.deploy.services import wait_until_ready
from switchyard.shared.jetstream import live_workers
from tests.e2e.conftest import TINY
from tests.e2e.test_metrics import scrape, value

MODEL = "tiny-speculative"
PROMPTS = ["one two three four one two three four one two three four one two",
           "The cat sat on the mat. The cat sat on the mat. The cat sat on"]


@pytest.mark.parametrize("method", ["ngram", "draft"])
async def test_a_speculative_worker_answers_as_a_plain_one_and_counts_its_drafts(e2e, system, auth, nats_url,
                                                                              method):
    draft = {"speculative_model": e2e.config.worker.model} if method == "draft" else {}
    # A name of its own: the other method's worker, stopped a moment ago, may still be listed under the shared one,
    # and readiness would be read from it.
    served = f"{MODEL}-{method}"
    worker = e2e.start_worker(served, max_num_seqs=4, speculative=method, num_speculative_tokens=4, **draft)
    try:
        wait_until_ready(system, served, timeout_s=120, watch=[worker])
        async with httpx.AsyncClient(base_url=system, headers=auth, timeout=60) as http:
            for prompt in PROMPTS:
                answers = []
                for model in (TINY, served):  # the same weights: the system's tiny worker decodes a token a step
                    r = await http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": 40,
                                                                 "temperature": 0, "ignore_eos": True})
                    assert r.status_code == 200, r.text
                    answers.append(r.json())
                plain, fast = answers
                assert fast["choices"][0]["text"] == plain["choices"][0]["text"]
                assert fast["usage"]["completion_tokens"] == plain["usage"]["completion_tokens"] == 40
            nc = await nats.connect(nats_url)
            try:
                (info,) = [w for w in await live_workers(nc.jetstream()) if w.model == served]
            finally:
                await nc.close()
            samples = await scrape(http, info.metrics_url)
        drafts = value(samples, "switchyard:spec_decode_num_draft_tokens_total", model=served)
        kept = value(samples, "switchyard:spec_decode_num_accepted_tokens_total", model=served)
        assert drafts >= kept > 0, (drafts, kept)
        # Steps without drafts where they were measured to lose: counted (how many depends on this machine's speed).
        assert ("switchyard:spec_decode_steps_without_drafts_total",
                frozenset({("model", served)})) in samples, sorted(name for name, _ in samples)
    finally:
        worker.stop()
