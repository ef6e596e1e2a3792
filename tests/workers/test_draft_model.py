"""Speculative decoding with a draft model (workers/engine/draft_model.py) on the tiny model: greedy outputs are the
ones decoding a token a step gives, whatever the draft; a draft that is the model itself has nearly every draft kept
(what shows its own KV cache follows each sequence); a draft pool that cannot hold a sequence gives it no drafts
and changes nothing; every block of the draft's cache is free again once the requests end."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from switchyard.workers.engine.engine import Engine, EngineConfig
from tests.workers.test_engine import RecordingEngine, run
from tests.workers.test_speculation import PROMPTS, REPEATING

DRAFT = EngineConfig(max_num_seqs=8, speculative="draft", num_speculative_tokens=4)
PLAIN = EngineConfig(max_num_seqs=8)


def _run_all(tiny, make_request, config: EngineConfig, requests: list[dict], draft=None,
             draft_blocks: int | None = None) -> tuple[RecordingEngine, dict]:
    """``requests`` run to their ends together, drafts from ``draft``; ``draft_blocks``: the draft's pool cut to
    that many free blocks."""
    model, tokenizer = tiny
    engine = RecordingEngine(model, tokenizer, config, draft)
    if draft_blocks is not None:
        engine._speculator._free = engine._speculator._free[:draft_blocks]
    for i, kwargs in enumerate(requests):
        engine.add_request(make_request(request_id=f"r{i}", **kwargs))
    return engine, run(engine)


def _outputs(engine: RecordingEngine, results: dict) -> dict:
    return {rid: (engine.token_ids[rid], res.text, res.final.finish_reason, res.final.usage.completion_tokens)
            for rid, res in results.items()}


@pytest.fixture(scope="module")
def other_draft(tiny):
    """The tiny model with every weight moved by noise as large as itself: a draft that is often wrong."""
    model = copy.deepcopy(tiny[0])
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * p.std())
    return model


GREEDY = [dict(prompt=p, temperature=0, max_tokens=40, ignore_eos=i % 2 == 0) for i, p in enumerate(PROMPTS)]


def test_the_model_as_its_own_draft_has_its_drafts_kept_and_the_output_is_the_same(tiny, make_request):
    plain, plain_results = _run_all(tiny, make_request, PLAIN, GREEDY)
    fast, fast_results = _run_all(tiny, make_request, DRAFT, GREEDY, draft=tiny[0])
    assert _outputs(fast, fast_results) == _outputs(plain, plain_results)
    # The same weights read the same tokens: a draft lost only to float rounding between a decode and a chunk.
    assert fast.num_accepted_draft_tokens >= 0.95 * fast.num_draft_tokens > 0
    assert fast.scheduler._num_steps < 0.5 * plain.scheduler._num_steps
    speculator = fast._speculator
    assert speculator._caches == {} and sorted(speculator._free) == list(range(speculator.runner.num_blocks))
    assert fast.num_free_blocks == fast.num_blocks


def test_a_draft_often_wrong_changes_no_greedy_output_and_a_seeded_sampled_one_repeats(tiny, make_request,
                                                                                      other_draft):
    requests = GREEDY + [dict(prompt=REPEATING[0], temperature=0.8, seed=7, max_tokens=30)]
    plain, plain_results = _run_all(tiny, make_request, PLAIN, requests)
    fast, fast_results = _run_all(tiny, make_request, DRAFT, requests, draft=other_draft)
    again, again_results = _run_all(tiny, make_request, DRAFT, requests, draft=other_draft)
    plain_out, fast_out = _outputs(plain, plain_results), _outputs(fast, fast_results)
    sampled = f"r{len(GREEDY)}"
    assert {k: v for k, v in fast_out.items() if k != sampled} == {k: v for k, v in plain_out.items() if k != sampled}
    assert _outputs(again, again_results)[sampled] == fast_out[sampled]
    assert fast_results[sampled].final.usage.completion_tokens == 30
    assert 0 < fast.num_accepted_draft_tokens < 0.9 * fast.num_draft_tokens


def test_a_draft_pool_that_cannot_hold_a_sequence_gives_it_no_drafts_and_changes_nothing(tiny, make_request):
    plain, plain_results = _run_all(tiny, make_request, PLAIN, GREEDY)
    fast, fast_results = _run_all(tiny, make_request, DRAFT, GREEDY, draft=tiny[0], draft_blocks=3)
    assert _outputs(fast, fast_results) == _outputs(plain, plain_results)
    assert fast.num_draft_tokens > 0  # the few sequences the 3 blocks held got drafts
    assert len(fast._speculator._free) == 3


def test_draft_needs_its_model(tiny):
    with pytest.raises(ValueError, match="draft model"):
        Engine(*tiny, DRAFT)


def test_the_draft_reads_a_long_prompt_over_several_steps_within_the_token_budget(tiny, make_request):
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=16, speculative="draft", num_speculative_tokens=4)
    long = dict(prompt=" ".join(REPEATING), temperature=0, max_tokens=40, ignore_eos=True)
    requests = [long, *GREEDY[:3]]
    plain, plain_results = _run_all(tiny, make_request, dataclasses.replace(config, speculative=None), requests)
    model, tokenizer = tiny
    fast = RecordingEngine(model, tokenizer, config, model)
    runner = fast._speculator.runner
    read: list[int] = []  # the tokens the draft reads, in each of its forward passes
    execute = runner.execute
    runner.execute = lambda chunks: read.append(sum(len(c.token_ids) for c in chunks)) or execute(chunks)
    for i, kwargs in enumerate(requests):
        fast.add_request(make_request(request_id=f"r{i}", **kwargs))
    fast_results = run(fast)
    assert _outputs(fast, fast_results) == _outputs(plain, plain_results)
    # The budget, and a row for each sequence's last token (4 at most) beyond it: never the long prompt at once.
    assert max(read) <= 16 + 4 < len(tokenizer.encode(long["prompt"]))
    assert fast.num_accepted_draft_tokens > 0
