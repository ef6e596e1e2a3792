"""Speculative decoding by prompt lookup (workers/engine/speculation.py): what it proposes, and that it changes no
greedy output (token for token against the engine without it, stop strings and EOS inside kept drafts included)
while taking fewer steps where the output repeats its prompt."""

from __future__ import annotations

import dataclasses
import json
import time
from types import SimpleNamespace

import jsonschema
import msgspec
import pytest

from switchyard.workers.engine.engine import Engine, EngineConfig
from switchyard.workers.engine.speculation import DraftBudget, PromptLookup, _Index
from tests.workers.test_engine import RecordingEngine, run

# Texts that repeat themselves, as an edit or a quote does: the tiny model's greedy output falls into loops too.
REPEATING = [
    "one two three four one two three four one two three four one two",
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n\ndef",
    "The cat sat on the mat. The cat sat on the mat. The cat sat on",
    "a b c d e f g a b c d e f g a b c",
]
OTHERS = ["Hi", "The quick brown fox jumps over the lazy dog.", "Once upon a time", "1 2 3 4 5 6 7 8 9 10 11"]
PROMPTS = REPEATING + OTHERS + [f"{p} {q}" for p in REPEATING for q in OTHERS[:3]]


def test_prompt_lookup_proposes_what_followed_the_latest_occurrence_of_the_longest_suffix():
    lookup = PromptLookup(num_tokens=3)
    index = _Index()
    assert lookup._lookup(index, [5, 6, 7, 8]) == []  # nothing repeats
    # [1, 2, 3] ended at position 2 and at 7: the latest earlier one (7) is followed by 20, 21, 22.
    assert lookup._lookup(index, [1, 2, 3, 9, 9, 1, 2, 3, 20, 21, 22, 23, 1, 2, 3]) == [20, 21, 22]
    assert lookup._lookup(_Index(), [7, 1, 2, 7, 1, 2]) == [7, 1, 2]
    # The index grows with the sequence: a later call sees the tokens added since.
    tokens = [4, 5, 6, 4, 5]
    index = _Index()
    assert lookup._lookup(index, tokens) == [6, 4, 5]
    tokens += [6, 8, 4, 5]
    assert lookup._lookup(index, tokens) == [6, 8, 4]
    assert lookup._lookup(index, [1, 1]) == [] and lookup._lookup(_Index(), [3]) == []


def test_a_sequence_whose_drafts_are_rejected_gets_fewer_and_one_whose_drafts_are_kept_more():
    budget = DraftBudget()

    def judged(drafts: list[int], at: int, tokens: list[int]) -> int:
        """How many drafts the sequence gets once ``drafts``, proposed at ``at``, met ``tokens``."""
        budget.drafts, budget.proposed_at = drafts, at
        return budget.allowed(tokens, 4)

    assert budget.allowed([0] * 10, 4) == 1  # one to begin with
    budget.limit = 4
    assert judged([1, 2, 3, 4], 10, [0] * 10 + [9]) == 2  # the first draft was wrong: none kept, half as many
    assert judged([1, 2], 11, [0] * 11 + [7]) == 1
    assert judged([1], 12, [0] * 12 + [7]) == 0  # a single draft rejected: none for two steps
    assert budget.allowed([0] * 14, 4) == 0
    assert budget.allowed([0] * 15, 4) == 1
    assert judged([3], 15, [0] * 15 + [7]) == 0  # rejected again: none for four
    assert [budget.allowed([0] * 16, 4) for _ in range(4)] == [0, 0, 0, 1]
    assert judged([5], 16, [0] * 16 + [5, 6]) == 2  # kept, and the model's token after it: twice as many
    assert judged([5, 6], 18, [0] * 18 + [5, 8]) == 2  # one of two kept: as it was
    assert judged([1, 2], 20, [0] * 20 + [1, 2, 3]) == 4
    assert judged([1, 2, 3, 4], 23, [0] * 23 + [1, 2, 3, 4, 5]) == 4  # never above the most a step checks


def _run_all(tiny, make_request, config: EngineConfig, requests: list[dict],
             eos: frozenset[int] | None = None) -> tuple[RecordingEngine, dict]:
    """``requests`` (make_request's keywords) run to their ends together; ``eos``: the token ids taken for EOS."""
    model, tokenizer = tiny
    engine = RecordingEngine(model, tokenizer, config)
    if eos is not None:
        engine._deltas._eos = eos
    reqs = [msgspec.structs.replace(make_request(request_id=f"r{i}", **{k: v for k, v in kwargs.items()
                                                                        if k != "response_format"}),
                                    response_format=kwargs.get("response_format"))
            for i, kwargs in enumerate(requests)]
    for req in reqs:
        engine.add_request(req)
    return engine, run(engine)


def _outputs(engine: RecordingEngine, results: dict) -> dict:
    return {rid: (engine.token_ids[rid], res.text, res.final.finish_reason, res.final.usage.completion_tokens)
            for rid, res in results.items()}


SPECULATIVE = EngineConfig(max_num_seqs=8, speculative="ngram", num_speculative_tokens=4)
PLAIN = EngineConfig(max_num_seqs=8)


def test_greedy_output_is_the_same_with_drafts_and_takes_fewer_steps(tiny, make_request):
    requests = [dict(prompt=p, temperature=0, max_tokens=40, ignore_eos=i % 2 == 0) for i, p in enumerate(PROMPTS)]
    plain, plain_results = _run_all(tiny, make_request, PLAIN, requests)
    fast, fast_results = _run_all(tiny, make_request, SPECULATIVE, requests)
    assert _outputs(fast, fast_results) == _outputs(plain, plain_results)
    assert fast.num_accepted_draft_tokens > 0.2 * fast.num_draft_tokens > 0, "drafts proposed and kept"
    assert fast.scheduler._num_steps < plain.scheduler._num_steps
    assert fast.num_free_blocks == fast.num_blocks, "every block is free once all requests ended"


def test_a_stop_string_or_eos_inside_kept_drafts_ends_the_output_where_decoding_one_by_one_does(tiny, make_request):
    # Stop strings cut from the plain run's own outputs, so each is met, some of them inside a step's drafts.
    reference, reference_results = _run_all(tiny, make_request, PLAIN, [
        dict(prompt=p, temperature=0, max_tokens=40, ignore_eos=True) for p in REPEATING])
    texts = [reference_results[f"r{i}"].text for i in range(len(REPEATING))]
    requests = [dict(prompt=p, temperature=0, max_tokens=40, stop=[text[len(text) // 2:][:3]])
                for p, text in zip(REPEATING, texts)]
    requests += [dict(prompt=p, temperature=0, max_tokens=40) for p in PROMPTS]
    # The tiny model's own EOS hardly comes: a token its repeating outputs hold, somewhere after their start, is
    # taken for EOS instead.
    eos = frozenset({reference.token_ids["r0"][12]})
    plain, plain_results = _run_all(tiny, make_request, PLAIN, requests, eos)
    fast, fast_results = _run_all(tiny, make_request, SPECULATIVE, requests, eos)
    assert _outputs(fast, fast_results) == _outputs(plain, plain_results)
    ended = [res.final.finish_reason for res in fast_results.values()]
    assert ended.count("stop") >= len(REPEATING) + 1 and "length" in ended
    assert fast.num_accepted_draft_tokens > 0


@pytest.mark.parametrize("max_tokens", [1, 2, 5])
def test_drafts_never_run_past_max_tokens(tiny, make_request, max_tokens):
    requests = [dict(prompt=p, temperature=0, max_tokens=max_tokens, ignore_eos=True) for p in REPEATING]
    fast, results = _run_all(tiny, make_request, SPECULATIVE, requests)
    assert all(res.final.usage.completion_tokens == max_tokens for res in results.values())
    assert all(len(ids) == max_tokens for ids in fast.token_ids.values())


def test_logprobs_requests_decode_one_token_a_step_and_a_seeded_sampled_one_repeats(tiny, make_request):
    requests = [dict(prompt=REPEATING[0], temperature=0.8, seed=7, max_tokens=30),
                dict(prompt=REPEATING[1], temperature=0, logprobs=True, top_logprobs=2, max_tokens=30),
                dict(prompt=REPEATING[2], temperature=0, max_tokens=30)]
    plain, plain_results = _run_all(tiny, make_request, PLAIN, requests)
    fast, fast_results = _run_all(tiny, make_request, SPECULATIVE, requests)
    again, again_results = _run_all(tiny, make_request, SPECULATIVE, requests)
    plain_out, fast_out = _outputs(plain, plain_results), _outputs(fast, fast_results)
    assert fast_out["r1"] == plain_out["r1"] and fast_out["r2"] == plain_out["r2"]
    # Drafts spend a seeded request's uniforms their own way: its output is its own, and the same every time.
    assert _outputs(again, again_results)["r0"] == fast_out["r0"]
    assert fast_results["r0"].final.usage.completion_tokens == 30
    logprobs = [lp for d in fast_results["r1"].deltas for lp in d.logprobs or []]
    assert len(logprobs) == fast_results["r1"].final.usage.completion_tokens
    assert fast.num_accepted_draft_tokens > 0


def test_a_sequence_forgets_its_index_when_it_ends(tiny, make_request):
    model, tokenizer = tiny
    engine = Engine(model, tokenizer, SPECULATIVE)
    engine.add_request(make_request(prompt=REPEATING[0], temperature=0, max_tokens=12))
    run(engine)
    assert engine._speculator is not None and engine._speculator._indexes == {}


TAGS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                   "minItems": 6, "maxItems": 6}},
        "required": ["tags"], "additionalProperties": False}


def test_under_a_grammar_drafts_follow_it_and_the_output_is_the_same(tiny, make_request):
    """Drafts are cut where the grammar forbids them and each row is masked as the grammar stands after the drafts
    before it: greedy outputs equal decoding a token a step, and sampled ones always validate."""
    from switchyard.shared.messages import ResponseFormat

    fmt = ResponseFormat("json_schema", TAGS, name="tags", strict=True)
    prompt = '{"tags": ["red", "red", "red", "red", "red", "red"]} {"tags": ["red", "red", "red", "red",'
    greedy = [dict(prompt=prompt, temperature=0, max_tokens=80, response_format=fmt)]
    sampled = [dict(prompt=prompt, temperature=1.0, seed=seed, max_tokens=80, response_format=fmt)
               for seed in range(6)]
    plain, plain_results = _run_all(tiny, make_request, PLAIN, greedy)
    fast, fast_results = _run_all(tiny, make_request, SPECULATIVE, greedy + sampled)
    assert _outputs(fast, {"r0": fast_results["r0"]}) == _outputs(plain, plain_results)
    for result in fast_results.values():
        jsonschema.validate(json.loads(result.text), TAGS)
    assert fast.num_accepted_draft_tokens > 0


def test_a_batch_whose_drafts_cost_more_than_they_give_goes_on_without_them_and_its_output_is_the_same(
        tiny, make_request):
    # Drafts made slow (100 ms a proposal, a draft model far too big, say): measured per token, no drafts win.
    requests = [dict(prompt=p, temperature=0, max_tokens=120, ignore_eos=True) for p in REPEATING * 2]
    plain, plain_results = _run_all(tiny, make_request, PLAIN, requests)
    model, tokenizer = tiny
    fast = RecordingEngine(model, tokenizer, dataclasses.replace(SPECULATIVE, speculation_measured=True))
    gate = fast._gate
    assert gate is not None
    propose = gate.speculator.propose

    def slow_propose(seqs):
        seqs = list(seqs)
        if seqs:
            time.sleep(0.1)
        propose(seqs)

    gate.speculator = SimpleNamespace(propose=slow_propose)
    for i, kwargs in enumerate(requests):
        fast.add_request(make_request(request_id=f"r{i}", **kwargs))
    fast_results = run(fast)
    assert _outputs(fast, fast_results) == _outputs(plain, plain_results)
    assert not gate.speculates(len(requests)) and gate.num_steps_off >= 30  # of some 110 steps
    assert fast.num_accepted_draft_tokens > 0  # they were kept while on: it is their cost that lost
