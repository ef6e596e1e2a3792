"""What a request body may ask for (domain/api/bounds.py), read off its JSON before validation and off its model
after: one rule, the same refusal either way, and a body far over the bounds refused without being validated."""

from __future__ import annotations

import pytest

from switchyard.domain.api import bounds
from switchyard.domain.api.bounds import check_bounds, check_raw_bounds, check_response_bounds
from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.api.responses import ResponseCreate
from switchyard.domain.errors import OpenAIError
from switchyard.shared.config import RequestLimits

LIMITS = RequestLimits(max_messages=4, max_stop_chars=8, max_schema_bytes=200)


def schema(branches: int) -> dict:
    return {"anyOf": [{"type": "object", "properties": {f"k{i}": {"const": f"é{i}"}}} for i in range(branches)]}


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **extra}


def tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": schema(4)}}


CASES = [
    (chat(messages=[{"role": "user", "content": "hi"}] * 5), "messages", "array_above_max_length"),
    (chat(stop="x" * 9), "stop", "invalid_value"),
    (chat(stop=["ok", "y" * 9]), "stop", "invalid_value"),
    (chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema(6)}}),
     "response_format", "invalid_value"),
    (chat(tools=[tool("f"), tool("g")]), "tools", "invalid_value"),
    ({"model": "m", "prompt": "hi", "stop": ["z" * 9]}, "stop", "invalid_value"),
    ({"model": "m", "input": [{"role": "user", "content": "hi"}] * 5}, "input", "array_above_max_length"),
    ({"model": "m", "input": "hi", "text": {"format": {"type": "json_schema", "name": "s", "schema": schema(6)}}},
     "text.format", "invalid_value"),
    ({"model": "m", "input": "hi", "tools": [{**tool(n)["function"], "type": "function"} for n in "fg"]},
     "tools", "invalid_value"),
]


def refusal(check) -> tuple[str | None, str | None, str]:
    with pytest.raises(OpenAIError) as raised:
        check()
    info = raised.value.info()
    return info.param, info.code, info.message


@pytest.mark.parametrize("body, param, code", CASES, ids=[c[1] + str(i) for i, c in enumerate(CASES)])
def test_a_body_over_a_bound_is_refused_alike_before_and_after_validation(body, param, code):
    kind = "chat" if "messages" in body else "response" if "input" in body else "completion"
    before = refusal(lambda: check_raw_bounds(body, LIMITS, kind))
    if kind == "response":
        after = refusal(lambda: check_response_bounds(ResponseCreate.model_validate(body), LIMITS))
    else:
        model = (ChatCompletionRequest if kind == "chat" else CompletionRequest).model_validate(body)
        after = refusal(lambda: check_bounds(model, LIMITS))
    assert before == after and before[:2] == (param, code)  # the same message too: the same numbers


def test_a_responses_history_counts_with_its_input():
    body = ResponseCreate.model_validate({"model": "m", "input": "hi"})
    check_response_bounds(body, LIMITS, num_history=3)
    assert refusal(lambda: check_response_bounds(body, LIMITS, num_history=4))[:2] == ("input",
                                                                                       "array_above_max_length")


def test_bodies_within_the_bounds_and_bodies_not_shaped_as_expected_are_left_to_validation():
    within = chat(messages=[{"role": "user", "content": "hi"}] * 4, stop=["12345678"],
                  response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema(1)}})
    check_raw_bounds(within, LIMITS, "chat")
    check_bounds(ChatCompletionRequest.model_validate(within), LIMITS)
    for odd in ([1, 2], "text", {"messages": "many"}, {"stop": 7}, {"tools": [{"function": "f"}, 3]},
                {"response_format": {"json_schema": ["x"]}}, {"input": {"role": "user"}}, {"text": "plain"}):
        for kind in ("chat", "completion", "response"):
            check_raw_bounds(odd, LIMITS, kind)  # nothing raised: validation will say what is wrong


def test_each_schema_is_serialized_once_when_the_raw_check_passes_its_sizes_on(monkeypatch):
    """The route's check of the model takes the sizes the raw check measured (gateway/admission.py): the same
    sizes a body that validates has, and no schema serialized a second time."""
    serialized = []
    size = bounds._size
    monkeypatch.setattr(bounds, "_size", lambda schema: serialized.append(schema) or size(schema))
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema(1)}}]
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema(1)}},
                tools=tools)
    sizes = check_raw_bounds(body, LIMITS, "chat")
    model = ChatCompletionRequest.model_validate(body)
    assert sizes is not None and len(serialized) == 2
    check_bounds(model, LIMITS, schema_sizes=sizes)
    assert len(serialized) == 2
    assert bounds.schema_bytes(model) == sizes  # what it would have measured itself

    serialized.clear()
    body = {"model": "m", "input": "hi", "tools": [{**tools[0]["function"], "type": "function"}],
            "text": {"format": {"type": "json_schema", "name": "s", "schema": schema(1)}}}
    sizes = check_raw_bounds(body, LIMITS, "response")
    assert sizes is not None and len(serialized) == 2
    response = ResponseCreate.model_validate(body)
    check_response_bounds(response, LIMITS, schema_sizes=sizes)
    assert len(serialized) == 2
    check_response_bounds(response, LIMITS)  # measured here, to the same sizes: within the bounds alike
    assert [size(s) for s in serialized[2:]] == list(sizes)
    assert check_raw_bounds({"model": "m", "prompt": "hi"}, LIMITS, "completion") is None  # no schemas


def test_sizes_passed_on_refuse_alike_and_history_still_counts():
    big = schema(6)
    body = chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": big}})
    model = ChatCompletionRequest.model_validate(body)
    measured = bounds.schema_bytes(model)
    assert refusal(lambda: check_bounds(model, LIMITS, schema_sizes=measured)) == \
        refusal(lambda: check_bounds(model, LIMITS)) == refusal(lambda: check_raw_bounds(body, LIMITS, "chat"))
    within = ChatCompletionRequest.model_validate(chat())
    sizes = check_raw_bounds(chat(), LIMITS, "chat")
    check_bounds(within, LIMITS, num_history=3, schema_sizes=sizes)
    assert refusal(lambda: check_bounds(within, LIMITS, num_history=4, schema_sizes=sizes))[:2] == (
        "messages", "array_above_max_length")
