"""Structured outputs, tools and service tiers through the real system with the official ``openai`` client: a
random model's replies parse into the client's pydantic model, its tool calls stream as deltas that assemble into
valid arguments, a named function is the one called, and flex runs and bills on the low tier."""

from __future__ import annotations

import json
from typing import Literal

import asyncpg
import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel, Field

from tests.e2e.conftest import TINY
from tests.support.system import make_key, poll

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a timezone.",
    "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 8}},
                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time there?"}]


@pytest.fixture(scope="module")
async def key(new_key) -> str:
    """A tenant of this module's own: its many requests must not spend the session key's per-minute limit."""
    _, secret = await new_key("pro", rpm_limit=100_000, tpm_limit=100_000_000)
    return secret


@pytest.fixture(scope="module")
def client(system: str, key: str):
    with OpenAI(base_url=f"{system}/v1", api_key=key, max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


class Person(BaseModel):
    # Bounded, so the random test model always completes an object within the token limit.
    name: str = Field(max_length=12)
    age: int = Field(ge=0, le=150)
    role: Literal["admin", "user", "guest"]
    tags: list[Literal["a", "b", "c"]] = Field(max_length=3)


def test_parse_returns_the_clients_pydantic_model(client: OpenAI):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model=TINY, messages=[{"role": "user", "content": "Describe someone."}], response_format=Person,
            max_completion_tokens=300, seed=seed)
        message = completion.choices[0].message
        assert isinstance(message.parsed, Person), message.content
        assert completion.choices[0].finish_reason == "stop"


def test_a_streamed_tool_call_arrives_as_deltas_that_assemble_into_valid_arguments(client: OpenAI):
    stream = client.chat.completions.create(model=TINY, messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                            parallel_tool_calls=False, stream=True, seed=11,
                                            max_completion_tokens=300)
    calls: dict[int, dict] = {}
    parts, finish, content = 0, None, ""
    for chunk in stream:
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for part in choice.delta.tool_calls or ():
            parts += 1
            call = calls.setdefault(part.index, {"id": None, "name": None, "arguments": ""})
            if part.id is not None:
                call["id"], call["name"] = part.id, part.function.name
            call["arguments"] += part.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    (call,) = calls.values()
    assert parts > 2, "the arguments stream as they are generated, not in one piece"
    assert call["id"].startswith("call_")
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call["name"]]
    jsonschema.validate(json.loads(call["arguments"]), schema)


def test_tool_choice_naming_a_function_forces_it_and_results_go_back(client: OpenAI):
    forced = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(3):
        response = client.chat.completions.create(model=TINY, messages=ASK, tools=[WEATHER, TIME],
                                                  tool_choice=forced, seed=seed, max_completion_tokens=300)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        (call,) = choice.message.tool_calls
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TIME["function"]["parameters"])
    # The call and its result go back to the model in the next request, as a client's agent loop sends them.
    follow_up = client.chat.completions.create(
        model=TINY, tools=[WEATHER, TIME], max_completion_tokens=5, messages=[
            *ASK, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": '{"time": "12:00"}'}])
    assert follow_up.choices[0].finish_reason in ("stop", "length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as refused:  # a tool result must say which call it answers
        client.chat.completions.create(model=TINY, messages=[*ASK, {"role": "tool", "content": "12:00"}])
    assert refused.value.body["param"] == "messages.1"


async def _request_row(database_url: str, request_id: str):
    conn = await asyncpg.connect(database_url)
    try:
        return await poll(lambda: conn.fetchrow("SELECT * FROM requests WHERE request_id = $1", request_id),
                          lambda row: row is not None, timeout_s=30, what="the request's usage row")
    finally:
        await conn.close()


async def test_service_tiers_run_where_they_say_and_bill_at_their_price(system: str, database_url: str):
    pro_key = await make_key(database_url, "tiers-pro", "pro")
    enterprise_key = await make_key(database_url, "tiers-enterprise", "enterprise")
    body = dict(model=TINY, messages=[{"role": "user", "content": "hi"}], max_completion_tokens=4)
    with OpenAI(base_url=f"{system}/v1", api_key=pro_key, max_retries=0) as pro, \
            OpenAI(base_url=f"{system}/v1", api_key=enterprise_key, max_retries=0) as enterprise:
        flex = pro.chat.completions.create(service_tier="flex", **body)
        default = pro.chat.completions.create(service_tier="auto", **body)
        with pytest.raises(openai.PermissionDeniedError) as refused:
            pro.chat.completions.create(service_tier="priority", **body)
        priority = enterprise.chat.completions.create(service_tier="priority", **body)
    assert (flex.service_tier, default.service_tier, priority.service_tier) == ("flex", "default", "priority")
    assert refused.value.body["param"] == "service_tier"
    rows = {name: await _request_row(database_url, r.id.removeprefix("chatcmpl-"))
            for name, r in (("flex", flex), ("default", default), ("priority", priority))}
    assert (rows["flex"]["tier"], rows["default"]["tier"], rows["priority"]["tier"]) == ("batch", "pro", "enterprise")
    # The default price ('*': 0.10 in, 0.20 out per million tokens), the batch tier at half of it.
    for name, discount in (("flex", 0.5), ("default", 1.0)):
        row = rows[name]
        expected = (row["prompt_tokens"] * 0.10 + row["completion_tokens"] * 0.20) / 1e6 * discount
        assert float(row["cost_usd"]) == pytest.approx(expected), name


async def test_tool_calls_and_results_round_trip_through_a_conversation(system: str, auth: dict):
    async with httpx.AsyncClient(base_url=system, headers=auth, timeout=60) as http:
        conv = (await http.post("/v1/conversations", json={"model": TINY})).json()["id"]
        turn = await http.post(f"/v1/conversations/{conv}/messages", json={
            "content": "What time is it in Paris?", "tools": [TIME], "tool_choice": "required",
            "max_completion_tokens": 300, "seed": 5})
        assert turn.status_code == 200, turn.text
        (call,) = turn.json()["choices"][0]["message"]["tool_calls"]
        answer = await http.post(f"/v1/conversations/{conv}/messages", json={
            "role": "tool", "tool_call_id": call["id"], "content": '{"time": "12:00"}', "tools": [TIME],
            "max_completion_tokens": 3})
        assert answer.status_code == 200, answer.text
        stored = (await http.get(f"/v1/conversations/{conv}/messages")).json()["data"]
        refused = await http.post(f"/v1/conversations/{conv}/messages", json={"role": "tool", "content": "x"})
    roles = [(m["role"], m.get("tool_call_id"), [c["id"] for c in m.get("tool_calls", [])]) for m in stored]
    assert roles[:3] == [("user", None, []), ("assistant", None, [call["id"]]), ("tool", call["id"], [])], roles
    assert stored[1]["tool_calls"][0]["function"] == call["function"]
    assert refused.status_code == 400
