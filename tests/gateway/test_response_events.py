"""A streamed response's events from fabricated worker deltas: OpenAI's order, numbering, and the final output
agreeing with what the deltas said; and the items a Responses API input becomes on the wire."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from switchyard.domain.api.response_items import output_items, to_messages
from switchyard.domain.api.response_object import status_of
from switchyard.domain.api.responses import ResponseCreate
from switchyard.gateway.response_events import ResponseEvents
from switchyard.shared.messages import ChatMessage, ErrorInfo, TokenDelta, ToolCall, ToolCallDelta


def decoded(chunks: list[bytes]) -> list[dict]:
    events = []
    for chunk in chunks:
        head, data = chunk.decode().strip().split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == f"event: {event['type']}"
        events.append(event)
    return events


def test_a_text_reply_streams_in_openais_order_and_closes_into_the_final_output():
    events = ResponseEvents("r1")
    chunks = events.opening({"id": "resp_r1", "status": "in_progress"})
    for text in ("Hel", "lo"):
        chunks += events.delta(TokenDelta("r1", text=text, num_tokens=1))
    chunks += events.close("completed")
    chunks.append(events.terminal({"id": "resp_r1", "status": "completed", "output": events.items}))
    out = decoded(chunks)
    assert [e["type"] for e in out] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    assert out[6]["text"] == "Hello" and out[8]["item"]["content"][0]["text"] == "Hello"
    assert events.items == output_items("r1", "Hello", [])  # the stream's items are the whole body's


def test_tool_calls_stream_their_arguments_and_get_items_after_the_text():
    events = ResponseEvents("r2")
    chunks = events.delta(TokenDelta("r2", text="Let me check.", num_tokens=3))
    chunks += events.delta(TokenDelta("r2", num_tokens=4, tool_calls=[
        ToolCallDelta(0, id="call_a", name="get_weather", arguments='{"city": '),
        ToolCallDelta(0, arguments='"Oslo"')]))
    chunks += events.delta(TokenDelta("r2", num_tokens=2, tool_calls=[ToolCallDelta(0, arguments="}")]))
    chunks += events.close("completed")
    out = decoded(chunks)
    kinds = [e["type"] for e in out]
    assert kinds.count("response.function_call_arguments.delta") == 3
    done = next(e for e in out if e["type"] == "response.function_call_arguments.done")
    assert done["arguments"] == '{"city": "Oslo"}' and done["name"] == "get_weather" and done["output_index"] == 1
    call = ToolCall("call_a", "get_weather", '{"city": "Oslo"}')
    assert events.items == output_items("r2", "Let me check.", [call])


def test_an_empty_reply_still_has_its_message_and_a_cut_one_is_incomplete():
    events = ResponseEvents("r3")
    out = decoded(events.close("incomplete"))
    assert [e["type"] for e in out][:2] == ["response.output_item.added", "response.content_part.added"]
    assert events.items[0]["status"] == "incomplete" and events.items[0]["content"][0]["text"] == ""
    assert decoded([events.terminal({"status": "incomplete"})])[0]["type"] == "response.incomplete"
    assert decoded([events.terminal({"status": "failed"})])[0]["type"] == "response.failed"
    error = decoded([events.error(ErrorInfo("boom", code="server_error"))])[0]
    assert error["type"] == "error" and error["code"] == "server_error" and error["message"] == "boom"


@pytest.mark.parametrize("reason, status, detail", [
    ("stop", "completed", None), ("tool_calls", "completed", None), ("length", "incomplete", "max_output_tokens"),
    ("content_filter", "incomplete", "content_filter"), ("cancelled", "cancelled", None), (None, "failed", None)])
def test_finish_reasons_become_statuses(reason, status, detail):
    got, incomplete = status_of(reason)
    assert got == status and (incomplete or {}).get("reason") == detail


def test_items_become_chat_messages_with_calls_joined_to_their_reply():
    body = ResponseCreate.model_validate({"model": "m", "instructions": "be brief", "input": [
        {"role": "developer", "content": "rules"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking.",
                                                              "annotations": []}], "status": "completed"},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}", "id": "fc_1"},
        {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{\"a\": 1}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]}]})
    assert to_messages(body.items) == [
        ChatMessage("system", "rules"),
        ChatMessage("assistant", "Checking.", tool_calls=[ToolCall("c1", "f", "{}"), ToolCall("c2", "f", '{"a": 1}')]),
        ChatMessage("tool", "one", tool_call_id="c1"), ChatMessage("tool", "two", tool_call_id="c2")]
    assert body.num_chars() == len("be brief") + len("rules") + len("Checking.") + 2 + 8 + 3 + 3
    assert body.screened_texts() == (["rules", "Checking.", "{}", '{"a": 1}', "one", "two", "be brief"], "input")


@pytest.mark.parametrize("extra", [{"previous_response_id": "resp_a", "conversation": "conv_b"},
                                   {"background": True, "stream": True}, {"unknown_thing": 1},
                                   {"tool_choice": "required"}, {"parallel_tool_calls": False},
                                   {"text": {"format": {"type": "json_schema"}}}, {"input": []}])
def test_bodies_that_cannot_be_honoured_are_refused(extra):
    with pytest.raises(ValidationError):
        ResponseCreate.model_validate({"model": "m", "input": "hi", **extra})


def test_events_made_again_leave_out_those_a_resuming_client_had_and_number_on():
    def made(after: int = -1) -> list[dict]:
        events = ResponseEvents("r1", after)
        chunks = events.opening({"id": "resp_r1", "status": "in_progress"})
        for text in ("Hel", "lo"):
            chunks += events.delta(TokenDelta("r1", text=text, num_tokens=1))
        return decoded([c for c in chunks if c])

    whole = made()
    assert made(after=3) == whole[4:] and made(after=len(whole) + 5) == []
