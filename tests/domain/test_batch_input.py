"""A batch input file read as a stream: the line cap applies while reading, a line the JSON parser gives up on
(20 000 nested brackets: RecursionError) fails alone, and the memory a file costs is a chunk's, not the file's
decoded and split (666 666 empty lines once cost 30 times their 2 MB)."""

from __future__ import annotations

import json
import tracemalloc

from switchyard.domain.batch_input import MAX_LINES, LineParser, parse_input

CHAT = "/v1/chat/completions"


def line(custom_id: str, content: str = "hi") -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": CHAT, "body": {
        "model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 3}}).encode() + b"\n"


def test_a_line_nested_past_the_parsers_depth_fails_alone():
    lines, errors = parse_input(line("a") + b"[" * 20_000 + b"\n" + line("b"), CHAT)
    assert lines == [] and [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json_line")]
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "metadata": {"k": "v"}}
    deep = {"custom_id": "deep", "method": "POST", "url": CHAT, "body": body}
    nested = json.dumps(deep).replace('"v"', "[" * 900 + "1" + "]" * 900).encode()  # parses, fails validation
    _, errors = parse_input(nested + b"\n", CHAT)
    assert errors[0]["line"] == 1 and errors[0]["code"] == "invalid_request", errors


def test_lines_split_across_chunks_are_read_whole_with_their_numbers():
    content = line("a") + b"\n" + line("b", "\u00e9t\u00e9 \u2603") + line("c")
    parser = LineParser(CHAT)
    got = []
    for i in range(0, len(content), 7):  # chunk edges inside lines, and inside a multi-byte character
        got += parser.feed(content[i:i + 7])
    got += parser.finish()
    assert parser.errors == [] and [(x.line_no, x.custom_id) for x in got] == [(1, "a"), (3, "b"), (4, "c")]
    assert json.loads(got[1].body_json)["messages"][0]["content"] == "\u00e9t\u00e9 \u2603"


def test_the_line_cap_applies_while_reading():
    parser = LineParser(CHAT)
    fed = 0
    chunk = line("x") * 1000  # the same custom_id: every line but the first is an error, until the list is full
    while not parser.done:
        parser.feed(chunk)
        fed += 1
    assert fed == 1 and len(parser.errors) == 100  # stopped at the errors' cap, not at the end of the input
    parser = LineParser(CHAT)
    for start in range(0, MAX_LINES + 10, 5000):
        parser.feed(b"".join(line(f"id-{i}") for i in range(start, start + 5000)))
        if parser.done:
            break
    parser.finish()
    assert parser.errors[-1]["code"] == "too_many_requests" and parser.num_lines == MAX_LINES + 1


def test_a_file_costs_a_chunks_memory_not_the_files():
    empty = b"\n" * 666_666
    tracemalloc.start()
    try:
        parser = LineParser(CHAT)
        for i in range(0, len(empty), 1 << 20):
            parser.feed(empty[i:i + (1 << 20)])
        parser.finish()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert parser.errors[0]["code"] == "empty_file"
    assert peak < 3 * (1 << 20), peak  # the chunk in hand and the line being read: not 30 x 2 MB
