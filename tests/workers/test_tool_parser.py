"""Tool calls read out of streamed text: whatever the pieces, the content and the calls come out whole."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from switchyard.workers.serving.tool_parser import ToolCallParser

CALL_A = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
CALL_B = '<tool_call>\n{"name": "lookup", "arguments": {"q": "a } b", "n": {"x": [1, 2]}}}\n</tool_call>'


def run(pieces: list[str]) -> tuple[str, list[dict]]:
    parser = ToolCallParser(lambda i: f"call_{i}")
    content, calls = [], {}
    for piece in [*pieces, None]:
        text, deltas = parser.feed(piece) if piece is not None else parser.finish()
        content.append(text)
        for d in deltas:
            call = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
            if d.id is not None:
                assert call["id"] is None, "a call's id comes once"
                call["id"], call["name"] = d.id, d.name
            call["arguments"] += d.arguments
    return "".join(content), [calls[i] for i in sorted(calls)]


def splits(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts})
    return [text[a:b] for a, b in zip([0, *points], [*points, len(text)])]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=30))
def test_calls_and_content_come_out_whole_however_the_text_is_cut(cuts):
    text = "Let me look. " + CALL_A + "\n" + CALL_B + "\n"
    content, calls = run(splits(text, cuts))
    assert content == "Let me look. "
    assert [(c["id"], c["name"]) for c in calls] == [("call_0", "get_weather"), ("call_1", "lookup")]
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris", "unit": "c"}
    assert json.loads(calls[1]["arguments"]) == {"q": "a } b", "n": {"x": [1, 2]}}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=10_000), max_size=20))
def test_text_without_calls_passes_through_even_with_almost_tags(cuts):
    text = "a < b, <tool and <tool_cal are not tags; </tool_call> alone is text too"
    content, calls = run(splits(text, cuts))
    assert (content, calls) == (text, [])


def test_a_tag_whose_inside_is_no_call_is_content():
    text = "x <tool_call>not json at all</tool_call> y"
    assert run([text]) == (text, [])


def test_arguments_cut_by_max_tokens_are_sent_as_far_as_they_came():
    content, calls = run(['<tool_call>\n{"name": "f", "arguments": {"a": "tru'])
    assert content == "" and calls == [{"id": "call_0", "name": "f", "arguments": '{"a": "tru'}]
