"""Constrained decoding on the engine: whatever a random model would say, its output follows the request's
response_format and its tool calls follow the tools' schemas; a schema that cannot compile is a 400 before compute.
"""

from __future__ import annotations

import json
from collections import defaultdict

import jsonschema
import pytest
import torch

from switchyard.shared.messages import ChatMessage, GenerateRequest, ResponseFormat, SamplingParams, ToolSpec, ToolUse
from switchyard.workers.engine.engine import Engine, EngineConfig
from switchyard.workers.model_store import load
from switchyard.workers.serving.prompts import RequestRejected
from tests.support.tiny_model import save_tiny_model
from tests.workers.test_engine import Result

# Bounded: a complete object always exists within max_tokens, whatever the model prefers.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "member": {"type": "boolean"},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 5}, "maxItems": 3},
    },
    "required": ["name", "age", "member", "role", "tags"],
    "additionalProperties": False,
}
WEATHER = ToolSpec("get_weather", "The weather in a city.", {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                     "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False})
TIME = ToolSpec("get_time", "The time in a timezone.", {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}}, "required": ["zone"],
    "additionalProperties": False})


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    """The tiny model with a context long enough for the default tool instructions."""
    model, tokenizer = load(save_tiny_model(tmp_path_factory.mktemp("tiny-long"), max_context=2048),
                            dtype="float32", device="cpu")
    return Engine(model, tokenizer, EngineConfig(max_num_seqs=8))


def request(request_id: str, response_format=None, tool_use=None, **sampling) -> GenerateRequest:
    params = {"max_tokens": 300, "temperature": 1.0, **sampling}
    return GenerateRequest(request_id, "tiny", "pro", SamplingParams(**params), 0.0, 0.0,
                           messages=[ChatMessage("user", "Describe someone, please.")],
                           response_format=response_format, tool_use=tool_use)


def run(engine: Engine) -> dict[str, Result]:
    results: dict[str, Result] = defaultdict(Result)
    for _ in range(5000):
        if not engine.has_unfinished_requests():
            return results
        for delta in engine.step():
            results[delta.request_id].deltas.append(delta)
    raise AssertionError("the requests did not finish")


def calls_of(deltas) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        for c in d.tool_calls or ():
            call = calls.setdefault(c.index, {"id": c.id, "name": c.name, "arguments": ""})
            call["arguments"] += c.arguments
    return [calls[i] for i in sorted(calls)]


def test_a_random_model_writes_valid_json_for_any_seed(engine):
    fmt = ResponseFormat("json_schema", PERSON, name="person", strict=True)
    compiled = engine.grammars.num_compiled
    for seed in range(4):
        engine.add_request(request(f"schema-{seed}", fmt, seed=seed, n=2))
    assert engine.grammars.num_compiled == compiled + 1, "one schema is compiled once, then taken from the cache"
    engine.add_request(request("object", ResponseFormat("json_object"), seed=7))
    engine.add_request(request("free", seed=7, max_tokens=20))  # in the same batch, unconstrained
    results = run(engine)
    for seed in range(4):
        by_choice: dict[int, str] = {}
        for d in results[f"schema-{seed}"].deltas:
            by_choice[d.index] = by_choice.get(d.index, "") + d.text
        assert len(by_choice) == 2
        for text in by_choice.values():
            jsonschema.validate(json.loads(text), PERSON)
    assert results["schema-0"].final.finish_reason == "stop"
    # Any object: its strings have no bound, so a random model may run out of tokens inside one.
    obj = results["object"]
    assert obj.text.startswith("{")
    assert obj.final.finish_reason == "length" or isinstance(json.loads(obj.text), dict)
    assert results["free"].final.usage.completion_tokens == 20  # the neighbours' masks did not touch it


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tools_give_only_calls_whose_arguments_validate(engine, parallel):
    use = ToolUse([WEATHER, TIME], choice="required", parallel=parallel)
    for seed in range(3):
        engine.add_request(request(f"req-{parallel}-{seed}", tool_use=use, seed=seed))
    results = run(engine)
    schemas = {t.name: t.parameters for t in use.tools}
    for seed in range(3):
        result = results[f"req-{parallel}-{seed}"]
        calls = calls_of(result.deltas)
        assert result.text == "" and result.final.finish_reason == "tool_calls", result.deltas[-3:]
        assert calls and (parallel or len(calls) == 1)
        assert len({c["id"] for c in calls}) == len(calls) and all(c["id"].startswith("call_") for c in calls)
        for c in calls:
            jsonschema.validate(json.loads(c["arguments"]), schemas[c["name"]])


def test_a_named_function_is_the_one_called(engine):
    use = ToolUse([WEATHER, TIME], choice="function", function="get_time", parallel=False)
    for seed in range(3):
        engine.add_request(request(f"named-{seed}", tool_use=use, seed=seed))
    results = run(engine)
    for seed in range(3):
        (call,) = calls_of(results[f"named-{seed}"].deltas)
        assert call["name"] == "get_time"
        jsonschema.validate(json.loads(call["arguments"]), TIME.parameters)


def test_auto_leaves_text_free_but_any_call_it_opens_is_valid(engine):
    use = ToolUse([WEATHER], choice="auto")
    for seed in range(6):
        engine.add_request(request(f"auto-{seed}", tool_use=use, seed=seed, max_tokens=60))
    results = run(engine)
    for seed in range(6):
        result = results[f"auto-{seed}"]
        assert "<tool_call>" not in result.text
        for call in calls_of(result.deltas):
            assert call["name"] == "get_weather"
            if result.final.finish_reason != "length":
                jsonschema.validate(json.loads(call["arguments"]), WEATHER.parameters)


@pytest.mark.parametrize("fmt, tool_use, param", [
    (ResponseFormat("json_schema", {"type": "object", "properties": {"a": {"type": "strin"}}}), None,
     "response_format"),
    (ResponseFormat("json_schema", {"$ref": "#/definitions/missing"}), None, "response_format"),
    (None, ToolUse([ToolSpec("f", parameters={"type": "object", "properties": {"x": {"minimum": "high"}}})],
                   choice="required"), "tools"),
])
def test_a_schema_that_cannot_compile_is_refused_before_compute(engine, fmt, tool_use, param):
    with pytest.raises(RequestRejected) as caught:
        engine.add_request(request("bad", fmt, tool_use))
    assert (caught.value.error.status, caught.value.error.param) == (400, param)
    assert not engine.has_unfinished_requests()


@pytest.mark.model
def test_smollm2_answers_in_the_schema_and_calls_the_tool_sensibly(smollm2_dir):
    model, tokenizer = load(smollm2_dir, dtype="float32", device="cpu")
    engine = Engine(model, tokenizer, EngineConfig(max_num_seqs=4))
    capital = {"type": "object", "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
               "required": ["country", "capital"], "additionalProperties": False}

    def ask(request_id: str, question: str, **fields) -> GenerateRequest:
        return GenerateRequest(request_id, "smollm2", "pro", SamplingParams(max_tokens=80, temperature=0), 0.0, 0.0,
                               messages=[ChatMessage("user", question)], **fields)

    engine.add_request(ask("json", "What is the capital of France? Answer in JSON.",
                           response_format=ResponseFormat("json_schema", capital, name="capital", strict=True)))
    weather = ToolSpec("get_weather", "Get the current weather in a city.", {
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    engine.add_request(ask("tool", "What's the weather like in Paris today?",
                           tool_use=ToolUse([weather], choice="required", parallel=False)))
    results = run(engine)
    answer = json.loads(results["json"].text)
    assert "paris" in answer["capital"].lower(), answer
    (call,) = calls_of(results["tool"].deltas)
    assert call["name"] == "get_weather" and "paris" in json.loads(call["arguments"])["city"].lower(), call


def test_masks_leave_exactly_the_allowed_tokens_of_the_masked_rows():
    from switchyard.workers.serving.guided import apply_masks

    generator = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32: the last word's spare bits are ignored
    bitmask = torch.randint(-2**31, 2**31 - 1, (2, 32), dtype=torch.int32, generator=generator)
    logits = torch.randn(3, vocab, generator=generator)
    original = logits.clone()
    apply_masks(logits, [0, 2], bitmask)
    for row, words in ((0, bitmask[0]), (2, bitmask[1])):
        allowed = [bool((int(words[t // 32]) >> (t % 32)) & 1) for t in range(vocab)]
        assert [not torch.isinf(v) for v in logits[row]] == allowed
        assert torch.equal(logits[row][torch.tensor(allowed)], original[row][torch.tensor(allowed)])
    assert torch.equal(logits[1], original[1])
