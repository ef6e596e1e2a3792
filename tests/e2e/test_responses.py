"""The Responses API end to end with the official ``openai`` client: bodies, streamed events, stored state
(previous_response_id, conversations, input items), background responses, refusals, tenancy and billing, on the
tiny test model (real gateway, worker, NATS and Postgres)."""

from __future__ import annotations

import json
from typing import Literal

import asyncpg
import httpx
import openai
import pytest
from pydantic import BaseModel

from tests.e2e.test_structured_outputs import auth, client, key  # noqa: F401 (a tenant of the module's own)
from tests.support.system import poll, usage_rows

MODEL = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}, "strict": True}
# Bounded arguments, so the random test model always ends its call within the tokens allowed.
BOUNDED = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                           "unit": {"enum": ["c", "f"]}},
                          "required": ["city", "unit"], "additionalProperties": False}}


def _tokens(rows) -> list[tuple[int, int]]:
    return [(row["prompt_tokens"], row["completion_tokens"]) for row in rows]

# A reply that runs for seconds: its schema allows no end of text before thousands of characters (a free reply of
# the random model may end within a poll's interval).
LONG = dict(max_output_tokens=3000, text={"format": {
    "type": "json_schema", "name": "story", "strict": True,
    "schema": {"type": "object", "properties": {"story": {"type": "string", "minLength": 2500}},
               "required": ["story"], "additionalProperties": False}}})


async def test_a_response_is_a_chat_turn_stored_and_billed_once(client, database_url, nats_url):
    r = client.responses.create(model=MODEL, input="Hello there", instructions="Be brief.", max_output_tokens=6,
                                temperature=0, metadata={"case": "one"})
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status in ("completed", "incomplete")
    assert r.model == MODEL and r.instructions == "Be brief." and r.metadata == {"case": "one"}
    assert [item.type for item in r.output][0] == "message"
    assert r.usage.output_tokens <= 6 and r.usage.input_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    stored = client.responses.retrieve(r.id)
    assert stored.output_text == r.output_text and stored.status == r.status
    items = client.responses.input_items.list(r.id)
    assert [i.content[0].text for i in items.data] == ["Hello there"]
    rows = await usage_rows(database_url, nats_url, r.id.removeprefix("resp_"))
    assert _tokens(rows) == [(r.usage.input_tokens, r.usage.output_tokens)]


async def test_the_end_user_is_kept_with_the_usage_record(client, database_url, nats_url):
    r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, safety_identifier="user-4242")
    assert r.safety_identifier == "user-4242"
    rows = await usage_rows(database_url, nats_url, r.id.removeprefix("resp_"), "end_user")
    assert [row["end_user"] for row in rows] == ["user-4242"]


async def test_streamed_events_come_in_order_and_add_up_to_the_response(client, database_url, nats_url):
    with client.responses.create(model=MODEL, input="Count", max_output_tokens=8, temperature=0,
                                 stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          events[-1].type]
    assert events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == text and 0 < final.usage.output_tokens <= 8
    assert client.responses.retrieve(final.id).output_text == text
    rows = await usage_rows(database_url, nats_url, final.id.removeprefix("resp_"))
    assert _tokens(rows) == [(final.usage.input_tokens, final.usage.output_tokens)]


def test_a_streamed_function_call_sends_its_arguments_as_deltas(client):
    with client.responses.create(model=MODEL, input="Weather in Oslo?", tools=[BOUNDED], tool_choice="required",
                                 parallel_tool_calls=False, max_output_tokens=300, temperature=0,
                                 stream=True) as stream:
        events = list(stream)
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    (added,) = [e for e in events if e.type == "response.output_item.added"]
    assert added.item.type == "function_call" and added.item.name == "get_weather"
    deltas = [i for i, t in enumerate(types) if t == "response.function_call_arguments.delta"]
    done = types.index("response.function_call_arguments.done")
    assert len(deltas) > 2, "the arguments stream as they are generated, not in one piece"
    assert types.index("response.output_item.added") < deltas[0] and deltas[-1] < done
    assert types[done + 1:] == ["response.output_item.done", "response.completed"]
    arguments = "".join(events[i].delta for i in deltas)
    assert events[done].arguments == arguments and json.loads(arguments)["unit"] in ("c", "f")
    (call,) = events[-1].response.output
    assert call.type == "function_call" and call.arguments == arguments and call.call_id.startswith("call_")


def test_parallel_tool_calls_false_gives_one_call(client):
    for temperature in (0.0, 1.0, 1.5):
        r = client.responses.create(model=MODEL, input="Weather in Oslo and Rome?", tools=[BOUNDED],
                                    tool_choice="required", parallel_tool_calls=False, max_output_tokens=300,
                                    temperature=temperature)
        assert r.parallel_tool_calls is False
        assert [item.type for item in r.output] == ["function_call"], r.output


def test_top_p_is_honoured(client):
    """A nucleus this small holds only the likeliest token: sampling at temperature 1 gives the greedy reply."""
    greedy = client.responses.create(model=MODEL, input="Say something", max_output_tokens=12, temperature=0)
    for _ in range(2):
        nucleus = client.responses.create(model=MODEL, input="Say something", max_output_tokens=12, temperature=1.0,
                                          top_p=1e-6)
        assert nucleus.top_p == 1e-6 and nucleus.output_text == greedy.output_text


def test_text_format_json_object_constrains_the_reply(client):
    for temperature in (0.0, 1.0):
        r = client.responses.create(model=MODEL, input="Reply in JSON", text={"format": {"type": "json_object"}},
                                    max_output_tokens=8, temperature=temperature)
        assert r.text.format.type == "json_object"
        assert r.output_text.lstrip().startswith("{"), r.output_text  # a random model's reply, held to JSON


async def test_a_repeated_prefix_is_reported_and_billed_as_cached(client, database_url, nats_url):
    shared = " ".join(f"line {i} of a long shared document" for i in range(40))
    first = client.responses.create(model=MODEL, input=shared + " First?", max_output_tokens=2, temperature=0)
    second = client.responses.create(model=MODEL, input=shared + " Second?", max_output_tokens=2, temperature=0)
    cached = second.usage.input_tokens_details.cached_tokens
    assert first.usage.input_tokens // 2 < cached < second.usage.input_tokens
    rows = await usage_rows(database_url, nats_url, second.id.removeprefix("resp_"), "cached_tokens")
    assert [row["cached_tokens"] for row in rows] == [cached]


def test_previous_response_id_sends_only_the_new_input(client):
    first = client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=5, temperature=0)
    second = client.responses.create(previous_response_id=first.id, input="What is my name?", max_output_tokens=5,
                                     temperature=0)
    assert second.model == MODEL and second.previous_response_id == first.id
    # The worker read the first turn (its input and its reply) before the new input.
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    assert [i.content[0].text for i in client.responses.input_items.list(second.id).data] == ["What is my name?"]


def test_parse_into_a_pydantic_model(client):
    class City(BaseModel):  # bounded, so the tiny model's reply always ends within the tokens allowed
        size: Literal["small", "large"]
        capital: bool

    r = client.responses.parse(model=MODEL, input="Describe a city.", text_format=City, max_output_tokens=60,
                               temperature=0)
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)


def test_function_tools_round_trip(client):
    r = client.responses.create(model=MODEL, input="Weather in Paris?", tools=[WEATHER], tool_choice="required",
                                max_output_tokens=40, temperature=0)
    calls = [item for item in r.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and calls[0].call_id
    follow = client.responses.create(
        model=MODEL, previous_response_id=r.id, tools=[WEATHER], max_output_tokens=5, temperature=0,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"}])
    assert follow.status in ("completed", "incomplete")
    assert follow.usage.input_tokens > r.usage.input_tokens


def test_the_whole_history_may_be_sent_as_items_instead(client):
    r = client.responses.create(model=MODEL, max_output_tokens=4, temperature=0, store=False, input=[
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"},
        {"role": "user", "content": "And now?"}], tools=[WEATHER])
    assert r.status in ("completed", "incomplete") and r.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)  # store=false: nothing kept


@pytest.mark.parametrize("extra, param", [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"include": ["message.output_text.logprobs"]}, "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning"),
    ({"input": [{"type": "input_image", "image_url": "x"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0]"),
    ({"background": True, "store": False}, "background"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"frequency_penalty": 1}, "frequency_penalty"),
])
async def test_what_cannot_be_honoured_is_refused_by_name(system, auth, extra, param):
    body = {"model": MODEL, "input": "hi", **extra}
    async with httpx.AsyncClient(base_url=system, headers=auth, timeout=30) as http:
        r = await http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


async def test_another_tenants_responses_are_not_found(system, client, new_key):
    r = client.responses.create(model=MODEL, input="secret", max_output_tokens=2)
    _, secret = await new_key()
    async with httpx.AsyncClient(base_url=system, headers={"Authorization": f"Bearer {secret}"}, timeout=30) as http:
        assert (await http.get(f"/v1/responses/{r.id}")).status_code == 404
        assert (await http.get(f"/v1/responses/{r.id}/input_items")).status_code == 404
        assert (await http.delete(f"/v1/responses/{r.id}")).status_code == 404
        follow = await http.post("/v1/responses", json={"model": MODEL, "input": "x", "previous_response_id": r.id})
        assert follow.status_code == 404
    assert client.responses.retrieve(r.id).id == r.id


async def test_input_items_are_listed_in_pages(client, system, auth):
    r = client.responses.create(model=MODEL, max_output_tokens=2, input=[
        {"role": "user", "content": text} for text in ("one", "two", "three")])

    def texts(page) -> list[str]:
        return [item.content[0].text for item in page.data]

    newest = client.responses.input_items.list(r.id, limit=2)  # OpenAI's default order: newest first
    assert texts(newest) == ["three", "two"] and newest.has_more
    rest = client.responses.input_items.list(r.id, limit=2, after=newest.last_id)
    assert texts(rest) == ["one"] and not rest.has_more
    assert texts(client.responses.input_items.list(r.id, order="asc")) == ["one", "two", "three"]
    async with httpx.AsyncClient(base_url=system, headers=auth, timeout=30) as http:
        refused = await http.get(f"/v1/responses/{r.id}/input_items", params={"limit": 0})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "limit"


def test_deleted_responses_are_gone_and_foreground_ones_cannot_be_cancelled(client):
    r = client.responses.create(model=MODEL, input="bye", max_output_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(r.id)  # only a background response can be
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


async def test_background_responses_are_polled_cancelled_and_billed_once(client, database_url, nats_url):
    r = client.responses.create(model=MODEL, input="Tell a story", max_output_tokens=4, background=True)
    assert r.status == "queued" and r.background is True
    done = await poll(lambda: _retrieve(client, r.id), lambda x: x.status not in ("queued", "in_progress"),
                      what="the background response to end")
    assert done.status in ("completed", "incomplete") and done.usage.output_tokens <= 4
    rows = await usage_rows(database_url, nats_url, r.id.removeprefix("resp_"))
    assert _tokens(rows) == [(done.usage.input_tokens, done.usage.output_tokens)]

    long = client.responses.create(model=MODEL, input="Tell a long story", background=True, **LONG)
    await poll(lambda: _retrieve(client, long.id), lambda x: x.status == "in_progress",
               what=lambda x: f"the long response to start (it is {x.status}: {x.usage}, {x.error})")
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    later = await poll(lambda: _retrieve(client, long.id), lambda x: x.status == "cancelled", timeout_s=5)
    assert later.status == "cancelled"


async def _retrieve(client, response_id: str):
    return client.responses.retrieve(response_id)


def test_a_conversation_keeps_the_turns_of_its_responses(client, system, auth):
    conv = httpx.post(f"{system}/v1/conversations", headers=auth, json={"model": MODEL, "system": "Be kind."}).json()
    r = client.responses.create(input="First question", conversation=conv["id"], max_output_tokens=3)
    assert r.conversation.id == conv["id"] and r.model == MODEL
    messages = httpx.get(f"{system}/v1/conversations/{conv['id']}/messages", headers=auth).json()["data"]
    assert [(m["role"], m["content"]) for m in messages] == [("user", "First question"),
                                                             ("assistant", r.output_text)]
    again = client.responses.create(input="Second", conversation={"id": conv["id"]}, max_output_tokens=3)
    assert again.usage.input_tokens > r.usage.input_tokens + r.usage.output_tokens


async def test_a_background_response_its_gateway_abandoned_is_failed_by_housekeeping(client, database_url,
                                                                                       nats_url):
    from switchyard.domain.responses import fail_abandoned

    r = client.responses.create(model=MODEL, input="Tell a long story", background=True, **LONG)
    await poll(lambda: _retrieve(client, r.id), lambda x: x.status == "in_progress",
               what=lambda x: f"the response to start (it is {x.status}: {x.usage})")
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=1)
    try:
        # As if its gateway had crashed: no news for a long time.
        await pool.execute("UPDATE responses SET updated_at = now() - interval '1 hour' WHERE id = $1", r.id)
        assert await fail_abandoned(pool) >= 1
        assert await fail_abandoned(pool, older_than_s=3600) == 0  # once
    finally:
        await pool.close()
    failed = client.responses.retrieve(r.id)
    assert failed.status == "failed" and failed.error.code == "server_error"
    client.responses.cancel(r.id)  # the run itself (alive here) is stopped: a final state stays as it is
    assert client.responses.retrieve(r.id).status == "failed"
    # The worker stopped it and billed what it ran: left going, its thousands of tokens would spend a seat for
    # nobody (and, under the deployment's block policy, a random word could trip a later test's counters).
    rows = await poll(lambda: usage_rows(database_url, nats_url, r.id.removeprefix("resp_"), "finish_reason"),
                      lambda rows: len(rows) == 1, timeout_s=30, what="the run's usage row")
    assert rows[0]["finish_reason"] == "cancelled"


async def test_a_flex_background_response_runs_on_the_batch_tier(client, database_url, nats_url):
    r = client.responses.create(model=MODEL, input="Whenever you can", max_output_tokens=3, background=True,
                                service_tier="flex")
    done = await poll(lambda: _retrieve(client, r.id), lambda x: x.status not in ("queued", "in_progress"),
                      what="the flex response to end")
    assert done.status in ("completed", "incomplete") and done.service_tier == "flex"
    rows = await usage_rows(database_url, nats_url, r.id.removeprefix("resp_"), "tier")
    assert [row["tier"] for row in rows] == ["batch"]
