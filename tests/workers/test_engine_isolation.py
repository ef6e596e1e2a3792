"""No request can hurt another inside the engine: random sampling parameters and request mixes (hypothesis) all
complete, and a request whose sampling or add fails ends alone, leaving its seat and blocks free."""

from __future__ import annotations

from collections import defaultdict
from unittest import mock

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import switchyard.workers.engine.next_tokens as next_tokens_module
import switchyard.workers.serving.choice as choice_module
from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams
from switchyard.workers.engine.engine import Engine, EngineConfig
from switchyard.workers.serving.prompts import RequestRejected

POISON_SEED = -12345  # the sample() double below raises for any batch with a row of this seed

WORDS = ["the", "fox", "jumps", "over", "a", "lazy", "dog", "!", "é", "日本", " ", "\n"]

sampling_params = st.fixed_dictionaries({
    "max_tokens": st.integers(1, 12),
    "temperature": st.one_of(st.just(0.0), st.floats(0.0, 2.0)),
    "top_p": st.floats(0.01, 1.0),
    "top_k": st.one_of(st.just(0), st.integers(1, 2**31 - 1)),  # beyond the vocabulary too
    "min_p": st.floats(0.0, 1.0),
    "presence_penalty": st.floats(-2.0, 2.0),
    "frequency_penalty": st.floats(-2.0, 2.0),
    "repetition_penalty": st.floats(0.01, 2.0),
    "seed": st.one_of(st.none(), st.integers(-(2**63), 2**63 - 1)),  # the edge's range, ends included
    "n": st.integers(1, 3),
    "ignore_eos": st.booleans(),
    "logprobs": st.booleans(),
    "top_logprobs": st.integers(0, 5),
    "stop": st.lists(st.sampled_from(WORDS).filter(bool), max_size=2),
})

requests = st.lists(
    st.tuples(sampling_params, st.lists(st.sampled_from(WORDS), min_size=0, max_size=40), st.booleans(),
              st.integers(0, 3)),
    min_size=1, max_size=6)


def _request(i: int, params: dict, words: list[str], chat: bool) -> GenerateRequest:
    text = " ".join(words)
    prompt = {"messages": [ChatMessage("user", text)]} if chat else {"prompt": text}
    return GenerateRequest(f"r{i}", "tiny", "pro", SamplingParams(**params), created_at=0.0, deadline_at=1e18,
                           **prompt)


def _drive(engine: Engine, arrivals: dict[int, list[GenerateRequest]], max_steps: int = 2000, rejected=None):
    """Add each request at its step (refusals into ``rejected``), step until all are done; returns the deltas per
    request."""
    deltas = defaultdict(list)
    for step in range(max_steps):
        for req in arrivals.pop(step, []):
            try:
                engine.add_request(req)
            except RequestRejected as exc:
                rejected[req.request_id] = exc.error
        if not arrivals and not engine.has_unfinished_requests():
            return deltas
        for d in engine.step():
            deltas[d.request_id].append(d)
    raise AssertionError("the engine did not finish")


@pytest.fixture(scope="module")
def engine(tiny):
    # Few seats and a small pool, so random mixes queue, share prefixes and get preempted.
    return Engine(*tiny, EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, kv_cache_bytes=1, max_model_len=128))


REAL_DRAW = next_tokens_module.draw


def _draw_or_fail(logits, params, *args, **kwargs):
    if any(p.seed == POISON_SEED for p in params):
        raise RuntimeError("injected sampling failure")
    return REAL_DRAW(logits, params, *args, **kwargs)


_TOO_LONG = ({"max_tokens": 12, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
              "frequency_penalty": 0.0, "repetition_penalty": 1.0, "seed": None, "n": 1, "ignore_eos": False,
              "logprobs": False, "top_logprobs": 0, "stop": []}, ["日本"] * 40)


@settings(max_examples=40, deadline=None)
@given(mix=requests, poison=st.integers(-1, 5))
@example(mix=[(*_TOO_LONG, True, 0), (*_TOO_LONG, False, 1), (_TOO_LONG[0], ["fox"], True, 0)], poison=-1)
def test_random_requests_complete_and_a_failing_one_fails_alone(engine, mix, poison):
    # Patched per example (a function-scoped monkeypatch would last across all of them).
    with mock.patch.object(next_tokens_module, "draw", _draw_or_fail):
        _check_mix(engine, mix, poison)


def _check_mix(engine: Engine, mix, poison: int) -> None:
    arrivals: dict[int, list[GenerateRequest]] = defaultdict(list)
    for i, (params, words, chat, at_step) in enumerate(mix):
        if i == poison:
            params = {**params, "seed": POISON_SEED, "temperature": 1.0}
        arrivals[at_step].append(_request(i, params, words, chat))
    expected = {req.request_id: req for reqs in arrivals.values() for req in reqs}
    rejected = {}
    deltas = _drive(engine, arrivals, rejected=rejected)

    # Refused before compute only for what can never run, with a 400: an empty completions prompt, or a prompt
    # that with its max_tokens does not fit the context (forty words of multi-byte text can pass 128 tokens).
    for request_id, error in rejected.items():
        req = expected[request_id]
        assert error.status == 400, error
        if error.code != "context_length_exceeded":
            assert req.prompt == "" and error.param == "prompt", error
        else:
            assert error.param == ("messages" if req.messages is not None else "prompt"), error
    assert set(deltas) == set(expected) - set(rejected)
    for request_id, req in expected.items():
        if request_id in rejected:
            continue
        finals = [d for d in deltas[request_id] if d.finish_reason is not None]
        assert sorted(d.index for d in finals) == list(range(req.sampling.n)), "one final per choice"
        if req.sampling.seed == POISON_SEED:
            assert all(d.finish_reason == "error" and d.error.status == 500 for d in finals)
            continue
        assert all(d.error is None and d.finish_reason in ("stop", "length") for d in finals), finals
        for index in range(req.sampling.n):
            tokens = sum(d.num_tokens for d in deltas[request_id] if d.index == index)
            assert 1 <= tokens <= req.sampling.max_tokens
    assert engine.num_free_blocks == engine.num_blocks, "every seat and block is free again"
    assert engine.num_running == engine.num_waiting == 0


def test_a_request_that_fails_while_being_added_leaves_nothing_behind(engine, monkeypatch):
    """The engine builds every choice before the scheduler sees any: a failure part-way (here the third choice's
    generator) leaves no orphaned sequence holding a seat."""
    made = []

    def make_generator(seed):
        made.append(seed)
        if len(made) == 3:
            raise OverflowError("injected")
        return None

    monkeypatch.setattr(choice_module, "make_generator", make_generator)
    bad = GenerateRequest("bad", "tiny", "pro", SamplingParams(n=3, seed=1, max_tokens=4), created_at=0.0,
                          deadline_at=1e18, prompt="the fox")
    with pytest.raises(OverflowError):
        engine.add_request(bad)
    assert not engine.has_unfinished_requests() and engine.num_free_slots == engine.max_num_seqs
    monkeypatch.undo()
    good = GenerateRequest("bad", "tiny", "pro", SamplingParams(n=3, seed=1, max_tokens=4, ignore_eos=True),
                           created_at=0.0, deadline_at=1e18, prompt="the fox")
    engine.add_request(good)  # the same id is free again
    deltas = _drive(engine, {})
    assert sum(d.num_tokens for d in deltas["bad"]) == 12
