"""The Batch API's file formats, without servers: input validation, request ids, output lines."""

from __future__ import annotations

import json

from switchyard.cli.batch import rewrite_input
from switchyard.domain.batch_format import output_line, request_id_for, response_body, wire_request
from switchyard.domain.batch_input import parse_input
from switchyard.shared.messages import BatchChoice, BatchResult, ToolCall, Usage

CHAT = "/v1/chat/completions"


def line(custom_id: str, **over) -> str:
    item = {"custom_id": custom_id, "method": "POST", "url": CHAT,
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}}
    return json.dumps({**item, **over})


def test_valid_file_keeps_line_numbers_and_skips_blank_lines():
    lines, errors = parse_input(f"{line('a')}\n\n{line('b')}\n".encode(), CHAT)
    assert errors == []
    assert [(x.line_no, x.custom_id, x.model) for x in lines] == [(1, "a", "m"), (3, "b", "m")]


def test_every_bad_line_is_reported_with_its_number():
    content = "\n".join([
        line("a"),
        "[1, 2]",
        line("a"),
        line("c", method="PUT"),
        line("d", url="/v1/completions"),
        line("e", body={"model": "m", "messages": [], "max_tokens": 3}),
        line("f", body={"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}),
        json.dumps({"method": "POST"}),
    ]).encode()
    _, errors = parse_input(content, CHAT)
    assert [(e["line"], e["code"]) for e in errors] == [
        (2, "invalid_json_line"), (3, "duplicate_custom_id"), (4, "invalid_method"), (5, "invalid_url"),
        (6, "invalid_request"), (7, "invalid_request"), (8, "missing_required_parameter")]
    assert errors[4]["param"] == "body.messages" and errors[5]["param"] == "body.stream"


def test_empty_and_binary_files_fail():
    assert parse_input(b"\n\n", CHAT)[1][0]["code"] == "empty_file"
    assert parse_input(b"\xff\xfe", CHAT)[1][0]["code"] == "invalid_json_line"  # a line that is not UTF-8


def test_request_ids_are_deterministic_and_subject_safe():
    rid = request_id_for("batch_1", "a")
    assert rid == request_id_for("batch_1", "a") != request_id_for("batch_2", "a") != request_id_for("batch_1", "b")
    assert rid.startswith("batch_req_") and "." not in rid and " " not in rid


def test_wire_request_is_on_the_batch_tier_with_the_result_subject():
    body = json.loads(line("a"))["body"]
    req = wire_request(CHAT, body, "batch_req_x", tenant_id="t", api_key_id="k", created_at=1.0, deadline_at=2.0,
                       result_subject="llm.result.batch_1", tier="batch")
    assert (req.tier, req.tenant_id, req.api_key_id, req.result_subject) == ("batch", "t", "k", "llm.result.batch_1")
    assert req.messages[0].content == "hi" and req.sampling.max_tokens == 3 and req.prompt is None
    text = wire_request("/v1/completions", {"model": "m", "prompt": "once"}, "r", tenant_id="t", api_key_id=None,
                        created_at=1.0, deadline_at=2.0, result_subject="s", tier="batch")
    assert text.prompt == "once" and text.sampling.max_tokens == 16


def test_output_line_carries_the_non_streaming_response_body():
    result = BatchResult("batch_req_x", "w", choices=[BatchChoice(0, "Hello", "stop")], usage=Usage(5, 2, 0))
    body = response_body(CHAT, "batch_req_x", "m", 100.0, result)
    assert body["object"] == "chat.completion" and body["id"] == "chatcmpl-batch_req_x"
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "Hello"}, "logprobs": None,
                                "finish_reason": "stop"}]
    assert body["usage"]["total_tokens"] == 7
    out = json.loads(output_line("a", "batch_req_x", {"status_code": 200, "request_id": "batch_req_x",
                                                      "body": body}, None))
    assert set(out) == {"id", "custom_id", "response", "error"} and out["custom_id"] == "a"


def test_cli_model_override_keeps_line_numbers():
    data = f"{line('a')}\n\nnot json\n{line('b')}\n".encode()
    out, url = rewrite_input(data, "other")
    rows = out.decode().splitlines()
    assert url == CHAT and len(rows) == 4 and rows[2] == "not json"
    assert json.loads(rows[0])["body"]["model"] == json.loads(rows[3])["body"]["model"] == "other"


def test_a_line_with_tools_and_a_schema_keeps_them_and_its_calls_come_back():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [tool], "tool_choice": "required",
            "response_format": fmt}
    req = wire_request(CHAT, body, "r", tenant_id="t", api_key_id=None, created_at=1.0, deadline_at=2.0,
                       result_subject="s", tier="batch")
    assert (req.tool_use.choice, req.tool_use.tools[0].name, req.response_format.type) == ("required", "f",
                                                                                           "json_schema")
    result = BatchResult("r", "w", choices=[BatchChoice(0, "", "tool_calls", [ToolCall("call_1", "f", "{}")])],
                         usage=Usage(5, 2, 0))
    (choice,) = response_body(CHAT, "r", "m", 1.0, result)["choices"]
    assert choice["message"] == {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}
    # What a batch cannot do is refused per line, naming the parameter.
    _, errors = parse_input(line("a", body={**body, "service_tier": "flex"}).encode(), CHAT)
    assert [e["param"] for e in errors] == ["body.service_tier"]
    _, errors = parse_input("\n".join([
        line("b", url="/v1/completions", body={"model": "m", "prompt": ["x", "y"]}),
        line("c", url="/v1/completions", body={"model": "m", "prompt": "x", "best_of": 2}),
    ]).encode(), "/v1/completions")
    assert [e["param"] for e in errors] == ["body.prompt", "body.best_of"]
