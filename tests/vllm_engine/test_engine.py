"""The vLLM engine on SmolLM2, driven as the worker drives it: deltas as ours sends them, tiers as vLLM priorities
(admitted first, preempted last), aborts that free the KV cache, the prefix cache scoped per tenant, every sampling
parameter honoured or refused with a 400, grammars, tool calls, continuations, the output safety filter, and KV
events in our hash chain."""

from __future__ import annotations

import json
import uuid

import jsonschema
import msgspec
import pytest

from switchyard.scheduler.kv_cache_manager import KVCacheManager
from switchyard.scheduler.request import Sequence
from switchyard.shared.kv_events import POOL, cache_salt, pack_hashes
from switchyard.shared.messages import ChatMessage, ErrorInfo, ResponseFormat, Resume, SafetyPolicy, ToolSpec, ToolUse

pytestmark = pytest.mark.model

LONG = ("Write a long story about a lighthouse keeper who finds a message in a bottle, with many details about the "
        "sea, the weather, the birds, the ships that pass and the village on the shore. ") * 4


def finals(steps) -> dict:
    """request id (and choice) -> its last delta."""
    return {(d.request_id, d.index): d for step in steps for d in step if d.finish_reason is not None}


def text_of(steps, request_id: str, index: int = 0) -> str:
    return "".join(d.text for step in steps for d in step if d.request_id == request_id and d.index == index)


def test_a_greedy_reply_streams_as_our_engine_sends_it(engine, request_of):
    req = request_of(max_tokens=24, temperature=0, logprobs=True, top_logprobs=2)
    prompt_tokens = engine.add(req)
    steps = engine.run()
    deltas = [d for step in steps for d in step]
    assert all(len(step) <= 1 for step in steps)  # one delta per choice per step
    last = deltas[-1]
    assert (last.finish_reason, last.is_last) == ("stop", True)
    assert text_of(steps, req.request_id) == "The capital of France is Paris."
    usage = last.usage
    assert usage.prompt_tokens == prompt_tokens and usage.completion_tokens == sum(d.num_tokens for d in deltas)
    assert sum(len(d.token_ids or ()) for d in deltas) == usage.completion_tokens
    # One logprob per content token (the EOS that ended it is not content), each with its 2 most likely tokens.
    logprobs = [lp for d in deltas for lp in d.logprobs or ()]
    assert len(logprobs) == usage.completion_tokens - 1
    assert "".join(lp.token for lp in logprobs) == "The capital of France is Paris."
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1] for lp in logprobs)
    assert all(lp.top[0] == (lp.token, pytest.approx(lp.logprob)) for lp in logprobs)  # greedy: the most likely


def test_tiers_are_vllm_priorities_enterprise_first(engine, request_of):
    # Five requests, four seats: the one left waiting is the batch request added first, not the enterprise one
    # added last.
    tiers = ["batch", "batch", "free", "pro", "enterprise"]
    reqs = [request_of(prompt="Once upon a time", tier=t, max_tokens=8, ignore_eos=True, temperature=0)
            for t in tiers]
    for req in reqs:
        engine.add(req)
    engine.step()
    stats = engine.stats()
    assert stats["running"] == {"enterprise": 1, "pro": 1, "free": 1, "batch": 1}
    assert stats["waiting"] == {"batch": 1}
    engine.run()


def test_when_the_kv_cache_runs_out_the_lowest_tier_is_preempted_and_finishes_last(engine, request_of):
    before = engine.stats()["num_preemptions"]
    # Three sequences of ~150 tokens: each takes one 128-token block at first, and a second one past 128 tokens,
    # which the cache's five cannot give all three.
    reqs = {t: request_of(prompt=f"{t}: once upon a time", tier=t, max_tokens=140, ignore_eos=True, temperature=0)
            for t in ["batch", "pro", "enterprise"]}
    for req in reqs.values():
        engine.add(req)
    steps = engine.run()
    ended_at = {d.request_id: i for i, step in enumerate(steps) for d in step if d.is_last}
    assert engine.stats()["num_preemptions"] > before
    order = sorted(ended_at, key=ended_at.get)
    assert order == [reqs[t].request_id for t in ("enterprise", "pro", "batch")]
    for req in reqs.values():  # preempted or not, every token arrives once
        (final,) = [d for step in steps for d in step if d.request_id == req.request_id and d.is_last]
        assert final.usage.completion_tokens == 140
        assert sum(d.num_tokens for step in steps for d in step if d.request_id == req.request_id) == 140


def test_an_abort_frees_the_seat_and_the_kv_blocks_and_ends_the_request_cancelled(engine, request_of):
    long = request_of(prompt=LONG, max_tokens=60, ignore_eos=True, temperature=0)  # two blocks
    engine.add(long)
    for _ in range(5):
        engine.step()
    held = engine.capacity()
    assert held["num_free_seats"] == 3 and held["kv_cache_usage"] >= 0.4  # two of five blocks
    assert engine.abort(long.request_id)
    (final,) = engine.step()
    assert (final.finish_reason, final.is_last) == ("cancelled", True)
    assert 0 < final.usage.completion_tokens < 60
    assert engine.capacity()["num_free_seats"] == 4
    short = request_of(prompt="Hi", max_tokens=3, ignore_eos=True)
    engine.add(short)
    engine.step()
    # What vLLM holds while the short request runs: its block, not the aborted one's two.
    assert 0 < engine.capacity()["kv_cache_usage"] < held["kv_cache_usage"]
    engine.run()
    assert not engine.abort(long.request_id)  # gone


def test_the_prefix_cache_is_scoped_per_tenant_unless_shared(engine, request_of):
    def cached(tenant: str, shared: bool = False) -> int:
        engine.add(request_of(prompt=LONG, tenant=tenant, max_tokens=1, shared_prefix_cache=shared))
        (final,) = [d for step in engine.run() for d in step]
        return final.usage.cached_tokens

    assert cached("alice") == 0
    assert cached("alice") >= 128  # its own blocks (vLLM-CPU's are 128 tokens)
    assert cached("bob") == 0  # never another tenant's
    assert cached("carol", shared=True) == 0
    assert cached("dave", shared=True) >= 128  # the operator's opt-in: one cache for all who share


def test_stop_strings_end_the_text_before_them(engine, request_of):
    req = request_of(max_tokens=30, temperature=0, stop=["Paris"])
    engine.add(req)
    steps = engine.run()
    assert text_of(steps, req.request_id) == "The capital of France is "
    assert finals(steps)[(req.request_id, 0)].finish_reason == "stop"


def test_seeds_repeat_and_n_choices_are_seeded_apart(engine, request_of):
    def texts(**fields) -> list[str]:
        req = request_of("Tell me a story.", max_tokens=12, temperature=1.0, **fields)
        engine.add(req)
        steps = engine.run()
        ends = [d for step in steps for d in step if d.finish_reason is not None]
        assert [d.is_last for d in ends] == [False] * (len(ends) - 1) + [True]
        return [text_of(steps, req.request_id, i) for i in range(fields.get("n", 1))]

    one = texts(seed=7)
    assert texts(seed=7) == one
    both = texts(seed=7, n=2)
    assert both[0] == one[0] and both[1] != both[0]


def test_logit_bias_min_p_top_k_and_penalties_are_honoured(engine, request_of):
    base = request_of(max_tokens=1, temperature=0)
    engine.add(base)
    (first,) = [d for step in engine.run() for d in step]
    token = first.token_ids[0]
    banned = request_of(max_tokens=1, temperature=0, logit_bias={token: -100.0})
    engine.add(banned)
    (other,) = [d for step in engine.run() for d in step]
    assert other.token_ids[0] != token
    varied = request_of(max_tokens=8, temperature=0.7, seed=1, top_k=5, min_p=0.05, presence_penalty=0.5,
                        frequency_penalty=0.5, repetition_penalty=1.2)
    assert isinstance(engine.add(varied), int)
    assert finals(engine.run())[(varied.request_id, 0)].usage.completion_tokens == 8


def test_echo_and_ignore_eos(engine, request_of):
    req = request_of(prompt="The capital of France is", echo=True, max_tokens=20, ignore_eos=True, temperature=0)
    engine.add(req)
    steps = engine.run()
    assert text_of(steps, req.request_id).startswith("The capital of France is Paris")
    final = finals(steps)[(req.request_id, 0)]
    assert (final.finish_reason, final.usage.completion_tokens) == ("length", 20)


def test_what_vllm_cannot_honour_or_nobody_could_is_a_400(engine, request_of):
    schema = ResponseFormat("json_schema", {"type": "object"})
    resumed = Resume([504, 3575], 3)
    cases = [
        (request_of(max_tokens=5, response_format=schema, resume=resumed), "unsupported_parameter", "response_format"),
        (request_of(max_tokens=5, presence_penalty=1.0, resume=resumed), "unsupported_parameter", "presence_penalty"),
        (request_of(max_tokens=5, response_format=ResponseFormat("json_schema", {"type": "nonsense"})),
         "invalid_request", "response_format"),
        (request_of("word " * 600, max_tokens=5), "context_length_exceeded", "messages"),
        (request_of(max_tokens=5, logit_bias={10**6: 1.0}), "invalid_value", "logit_bias"),
    ]
    for req, code, param in cases:
        error = engine.add(req)
        assert isinstance(error, ErrorInfo) and (error.code, error.param, error.status) == (code, param, 400), error
    assert engine.capacity()["num_free_seats"] == 4  # nothing left behind


def test_a_json_schema_reply_follows_it(engine, request_of):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                               "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    req = request_of("Give me a city as JSON.", max_tokens=60, temperature=0,
                     response_format=ResponseFormat("json_schema", schema))
    engine.add(req)
    steps = engine.run()
    reply = json.loads(text_of(steps, req.request_id))
    jsonschema.validate(reply, schema)
    assert finals(steps)[(req.request_id, 0)].finish_reason == "stop"


def test_tool_calls_stream_as_tool_call_deltas(engine, request_of):
    weather = ToolSpec("get_weather", "The weather in a city.", {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 10}},
        "required": ["city"], "additionalProperties": False})
    req = request_of("What is the weather in Paris?", max_tokens=60, temperature=0,
                     tool_use=ToolUse([weather], choice="required", parallel=False))
    engine.add(req)
    steps = engine.run()
    parts = [p for step in steps for d in step for p in d.tool_calls or ()]
    assert parts and parts[0].name == "get_weather" and parts[0].id.startswith("call_")
    arguments = json.loads("".join(p.arguments for p in parts))
    assert isinstance(arguments["city"], str)
    assert finals(steps)[(req.request_id, 0)].finish_reason == "tool_calls"


def resumed_run(engine, request_of, max_tokens: int, num_sent: int, **resume) -> tuple[str, str, list, str]:
    """A greedy reply run whole, then again as a continuation after its first ``num_sent`` tokens (``resume``: more
    Resume fields): the whole text, the text the client had got, the continuation's steps and its request id."""
    whole = request_of(prompt="Once upon a time", max_tokens=max_tokens, ignore_eos=True, temperature=0)
    engine.add(whole)
    steps = engine.run()
    ids = [t for step in steps for d in step for t in d.token_ids or ()]
    # The text the client got of the first tokens (as our engine would have sent it) when the worker died.
    sent = request_of(prompt="Once upon a time", max_tokens=num_sent, ignore_eos=True, temperature=0)
    engine.add(sent)
    sent_text = text_of(engine.run(), sent.request_id)
    rest = request_of(prompt="Once upon a time", max_tokens=max_tokens, ignore_eos=True, temperature=0,
                      resume=Resume(ids[:num_sent], len(sent_text), **resume))
    engine.add(rest)
    return text_of(steps, whole.request_id), sent_text, engine.run(), rest.request_id


def test_a_continuation_goes_on_from_the_resumed_tokens_exactly(engine, request_of):
    text, sent_text, steps, rest_id = resumed_run(engine, request_of, 30, 12)
    assert text.startswith(sent_text)
    assert sent_text + text_of(steps, rest_id) == text
    assert finals(steps)[(rest_id, 0)].usage.completion_tokens == 30  # the whole request, billed once


def test_an_engine_without_a_kv_connector_serves_whole_requests_and_refuses_a_prefill(engine, request_of):
    assert engine.info["roles"] == ["both"]
    prefill = request_of(prompt="Once upon a time", max_tokens=30, temperature=0, handover=True)
    error = engine.add(prefill)
    assert isinstance(error, ErrorInfo) and (error.code, error.status) == ("handover_unsupported", 500)
    assert not engine.run()  # nothing left behind to run, or to wait for


def test_a_continuation_naming_a_vllm_prefills_blocks_computes_its_prompt_without_a_connector(engine, request_of):
    # What a vLLM prefill worker would have named, on a prefill instance that is not there.
    blocks = {"do_remote_prefill": True, "remote_block_ids": [[1]], "remote_engine_id": "gone",
              "remote_request_id": "p-1", "remote_host": "127.0.0.1", "remote_port": 1, "tp_size": 1}
    text, sent_text, steps, rest_id = resumed_run(engine, request_of, 20, 1, handovers=1, prefill_worker="w-p",
                                                  kv_transfer=blocks)
    assert sent_text + text_of(steps, rest_id) == text
    assert finals(steps)[(rest_id, 0)].usage.completion_tokens == 20
    assert "has no KV connector" in engine.log_path.read_text()  # computed, and said so


def test_the_output_filter_halts_a_reply_before_the_flagged_word(engine, request_of):
    policy = SafetyPolicy("block", rules={"places": [r"\bparis\b"]})
    req = request_of(max_tokens=30, temperature=0, safety=policy)
    engine.add(req)
    steps = engine.run()
    assert "Paris" not in text_of(steps, req.request_id)
    assert finals(steps)[(req.request_id, 0)].finish_reason == "content_filter"


def test_kv_events_name_the_prompts_blocks_in_our_chain_with_its_message_prefixes(engine, request_of):
    """vLLM's own KV events, as the worker publishes them: the prompt's full blocks of vLLM's size (128 tokens on a
    CPU), named by our hash chain over the prompt's tokens and the tenant's cache salt, as our engine names them,
    and the chat's message prefixes mapped to those blocks."""
    assert engine.info["kv_block_size"] == 128
    engine.take_kv_changes()  # what the tests before left
    system = "You are the keeper's assistant. " + LONG  # ~190 tokens: the first block ends in it
    req = msgspec.structs.replace(request_of(max_tokens=1, temperature=0, tenant=f"kv-{uuid.uuid4().hex[:8]}"),
                                  messages=[ChatMessage("system", system), ChatMessage("user", LONG)])
    token_ids, segments = engine.prepare(req)
    engine.add(req)
    engine.run()
    changes = engine.take_kv_changes()
    assert changes is not None and changes.block_size == 128
    seq = Sequence(req.request_id, token_ids, max_tokens=1, cache_salt=cache_salt(req))
    ours = [h for h, _ in KVCacheManager(num_blocks=8, block_size=128).chain(seq)]
    assert len(ours) >= 2
    # A tenant of its own: no block of this salt was cached before, so vLLM stored each, in order.
    assert changes.stored[POOL][:len(ours)] == ours
    assert set(ours) <= set(engine.kv_listing()[POOL])
    # Message prefixes: the system prompt's ends within block 1, the conversation's takes the rest.
    assert changes.prefixes == segments and len(segments) == 2
    assert segments[0].parent is None and segments[0].hashes == pack_hashes(ours[:1])
    assert segments[1].parent == segments[0].key and segments[1].hashes == pack_hashes(ours[1:])
    assert engine.take_kv_changes().is_empty  # each handed out once
    # Two prompts of three blocks and a bit each need four of the pool's five blocks: ours, the least recently used,
    # are evicted, and removed in our chain.
    for i in range(2):
        engine.add(request_of(prompt=f"{i}: " + 2 * LONG + LONG[:len(LONG) // 2], max_tokens=1))
        engine.run()
    removed = engine.take_kv_changes().removed[POOL]
    assert set(ours) <= set(removed) and not set(ours) & set(engine.kv_listing()[POOL])
