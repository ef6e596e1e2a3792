"""The output filter in the engine, on the tiny random model forced by ``logit_bias`` to write " a" and "s"
tokens, so an offensive word ("ass") appears within a few steps: a ``block`` policy halts the choice with
``content_filter``, frees its seat at once and never sends the word; ``log`` lets it run and reports it."""

from __future__ import annotations

import re

import pytest

from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams
from switchyard.shared.safety import wire_policy
from switchyard.workers.engine.engine import Engine, EngineConfig
from tests.workers.test_engine import Result, collect

MAX_TOKENS = 120
BAD_WORD = re.compile(r"\bass\b")


@pytest.fixture(scope="module")
def engine(tiny) -> Engine:
    model, tokenizer = tiny
    return Engine(model, tokenizer, EngineConfig(max_num_seqs=4))


def forced(engine: Engine, request_id: str, mode: str | None, seed: int = 4, n: int = 1) -> GenerateRequest:
    """A request whose every token is " a" or "s" (both +100: the random model picks between them)."""
    tok = engine.tokenizer
    bias = {tok.convert_tokens_to_ids("Ġa"): 100.0, tok.convert_tokens_to_ids("s"): 100.0}
    return GenerateRequest(request_id, "tiny", "pro",
                           SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=seed, logit_bias=bias,
                                          ignore_eos=True, n=n),
                           0.0, 0.0, messages=[ChatMessage("user", "Say something.")],
                           safety=None if mode is None else wire_policy(mode, {}, 0.9))


def step_until_final(engine: Engine, request_id: str) -> tuple[Result, int]:
    """Step until the request's last choice ends; the result and how many steps that took."""
    result = Result()
    for steps in range(1, 10 * MAX_TOKENS):
        collect({request_id: result}, [d for d in engine.step() if d.request_id == request_id])
        if result.deltas and result.final.finish_reason is not None:
            return result, steps
    raise AssertionError("the request never finished")


def test_block_halts_the_choice_at_the_word_and_frees_its_seat_at_once(engine):
    free_blocks = engine.num_free_blocks
    engine.add_request(forced(engine, "blocked", "block"))
    result, steps = step_until_final(engine, "blocked")
    assert result.final.finish_reason == "content_filter"
    # Halted in the step that completed the word (the token after it, " a", ends the word), not one token later:
    # short of max_tokens, and its seat and KV blocks are free now.
    generated = engine.tokenizer.decode([t for d in result.deltas for t in d.token_ids or ()])
    first = BAD_WORD.search(generated)
    assert first is not None and generated[first.end():] == " a", generated
    assert result.final.usage.completion_tokens < MAX_TOKENS
    assert engine.scheduler.get("blocked") is None and not engine.has_unfinished_requests()
    assert engine.num_free_blocks == free_blocks
    # Every token is " a" or "s": the text sent is what came before the word, and not even a part of it.
    assert set(result.text) <= {" ", "a", "s"}
    assert not BAD_WORD.search(result.text)
    assert result.text == "" or result.text.endswith(" ")  # the partial word that became "ass" was held back
    assert [(e.request_id, e.category, e.action) for e in engine.safety.take_events()] == \
        [("blocked", "profanity", "blocked")]


def test_log_lets_the_same_reply_run_to_its_end_and_reports_it_once(engine):
    engine.add_request(forced(engine, "logged", "log"))
    result, _ = step_until_final(engine, "logged")
    assert result.final.finish_reason == "length"
    assert result.final.usage.completion_tokens == MAX_TOKENS
    assert BAD_WORD.search(result.text)
    assert [(e.request_id, e.action) for e in engine.safety.take_events()] == [("logged", "logged")]


def test_no_policy_no_filter(engine):
    engine.add_request(forced(engine, "unfiltered", None))
    result, _ = step_until_final(engine, "unfiltered")
    assert result.final.finish_reason == "length" and BAD_WORD.search(result.text)
    assert engine.safety.take_events() == []


def test_each_choice_is_judged_on_its_own(engine):
    engine.add_request(forced(engine, "two", "block", seed=7, n=2))
    finals = {}
    texts = {0: "", 1: ""}
    for _ in range(10 * MAX_TOKENS):
        for d in engine.step():
            texts[d.index] += d.text
            if d.finish_reason is not None:
                finals[d.index] = d.finish_reason
        if len(finals) == 2:
            break
    assert finals == {0: "content_filter", 1: "content_filter"}
    assert not any(BAD_WORD.search(t) for t in texts.values())
    assert {e.index for e in engine.safety.take_events()} == {0, 1}
    assert not engine.has_unfinished_requests()
