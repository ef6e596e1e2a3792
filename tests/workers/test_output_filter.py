"""The streaming output filter on its own (workers/serving/output_filter.py): words are judged whole, however the
deltas split them, and what a block policy halts never leaves in part."""

from __future__ import annotations

import pytest

from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams
from switchyard.shared.safety import wire_policy
from switchyard.workers.serving.output_filter import OutputSafety, StreamGuard

RULES = {"codename": [r"(?<!\w)project\s+zorp(?!\w)"]}


def request(mode: str | None, rules=RULES, threshold: float | None = 0.9) -> GenerateRequest:
    return GenerateRequest("req-1", "tiny", "pro", SamplingParams(), 0.0, 0.0,
                           messages=[ChatMessage("user", "hi")],
                           safety=None if mode is None else wire_policy(mode, rules, threshold))


def guard(mode: str = "block", **kwargs) -> tuple[StreamGuard, OutputSafety]:
    safety = OutputSafety()
    made = safety.guard(request(mode, **kwargs), 0)
    assert made is not None
    return made, safety


def stream(g: StreamGuard, deltas: list[str], reason: str = "stop") -> tuple[str, str]:
    """Every delta through the guard, then the end: (what the client got, the finish reason)."""
    sent = []
    for d in deltas:
        sent.append(g.feed(d))
        if g.is_halted:
            return "".join(sent), "content_filter"
    text, reason = g.finish("", reason)
    return "".join(sent) + text, reason


def test_clean_text_passes_whole_whatever_the_deltas():
    text = "The quick brown fox jumps over the lazy dog. It was 3 p.m.; nothing—at all—happened!\n"
    for size in (1, 2, 3, 7, len(text)):
        g, safety = guard()
        sent, reason = stream(g, [text[i:i + size] for i in range(0, len(text), size)])
        assert (sent, reason) == (text, "stop")
        assert safety.take_events() == []


def test_a_bad_word_split_across_two_deltas_halts_before_any_of_it_is_sent():
    g, safety = guard()
    assert g.feed("well, you are an a") == "well, you are an "  # "a" may be the start of a word: held
    assert g.feed("ss") == ""  # still a word in progress
    assert not g.is_halted
    assert g.feed("hole. And more") == ""  # "asshole" complete: flagged
    assert g.is_halted
    assert g.feed(" text after") == ""  # nothing more, ever
    assert g.finish("the end", "stop") == ("", "content_filter")
    events = safety.take_events()
    assert [(e.request_id, e.index, e.tier, e.category, e.action) for e in events] == \
        [("req-1", 0, "pro", "profanity", "blocked")]
    assert safety.take_events() == []  # taken once


def test_held_text_never_leaks_when_the_end_trips_the_filter():
    g, safety = guard()
    assert g.feed("I think ") == "I think "
    assert g.feed("this is sh") == "this is "  # "sh" held: the next token may make it a word of its own
    assert g.finish("it", "length") == ("", "content_filter")  # the last token completes it: judged, halted
    assert [e.action for e in safety.take_events()] == ["blocked"]
    clean, _ = guard()
    assert clean.feed("this is sh") == "this is "
    assert clean.finish("ort", "length") == ("short", "length")  # the same held text, clean: sent at the end


def test_a_rule_spanning_deltas_is_seen_with_the_text_before_it():
    g, safety = guard(threshold=None)
    assert g.feed("the launch of project ") == "the launch of project "
    assert g.feed("zo") == ""
    assert g.feed("rp is next") == ""
    assert g.is_halted and safety.take_events()[0].category == "codename"


def test_log_lets_everything_through_and_reports_each_choice_once():
    g, safety = guard("log")
    text = "you are an asshole, a real asshole"
    sent, reason = stream(g, [text[i:i + 3] for i in range(0, len(text), 3)])
    assert (sent, reason) == (text, "stop")
    assert [(e.category, e.action) for e in safety.take_events()] == [("profanity", "logged")]


def test_a_cancelled_choice_sends_only_what_it_was_given():
    g, safety = guard()
    assert g.feed("so you are an ass") == "so you are an "
    assert g.finish("", "cancelled") == ("", "cancelled")
    assert safety.take_events() == []


def test_a_continuation_judges_its_first_words_with_the_text_the_client_already_has():
    g, safety = guard(threshold=None)
    g.prime("the launch of project")
    assert g.feed(" zorp starts") == ""
    assert g.is_halted and safety.take_events()[0].category == "codename"


def test_a_run_of_word_characters_is_not_held_forever():
    g, _ = guard(threshold=None)
    blob = "A" * 200
    assert g.feed(blob) == blob  # no word is this long: released rather than held until the end


@pytest.mark.parametrize("mode", [None, "off"])
def test_no_guard_without_a_policy(mode):
    req = request(None)
    if mode == "off":
        req.safety = wire_policy("off", RULES, 0.9)
    assert OutputSafety().guard(req, 0) is None
