"""SSE event ids of resumable streams (gateway/stream_ids.py): what a gateway taking a stream over leaves out."""

from __future__ import annotations

import pytest

from switchyard.gateway.stream_ids import EventIds, Position, parse_event_id
from switchyard.shared.messages import TokenDelta


def delta(attempt: int, seq: int) -> TokenDelta:
    return TokenDelta("r", attempt=attempt, seq=seq)


def test_each_event_is_numbered_by_its_delta_and_a_taker_writes_only_those_after_the_clients():
    ids = EventIds("req1")
    first = ids.of_delta(delta(0, 0), [b"data: a\n\n", b"data: b\n\n"])
    assert first == [b"id: req1.0.0.0\ndata: a\n\n", b"id: req1.0.0.1\ndata: b\n\n"]
    assert ids.of_delta(delta(0, 1), []) == []
    assert ids.of_delta(delta(1, 0), [b"data: c\n\n"]) == [b"id: req1.1.0.0\ndata: c\n\n"]
    assert ids.more([b"data: [DONE]\n\n"]) == [b"id: req1.1.0.1\ndata: [DONE]\n\n"]

    taker = EventIds("req1", after=Position(0, 0, 0))
    assert taker.of_delta(delta(0, 0), [b"data: a\n\n", b"data: b\n\n"]) == [b"id: req1.0.0.1\ndata: b\n\n"]
    assert taker.of_delta(delta(1, 0), [b"data: c\n\n"]) == [b"id: req1.1.0.0\ndata: c\n\n"]


def test_an_id_parses_back_to_its_request_and_position():
    assert parse_event_id("abc-p0.1.22.3") == ("abc-p0", Position(1, 22, 3))


@pytest.mark.parametrize("bad", ["", "abc", "abc.1.2", "abc.x.2.3", ".1.2.3", "abc.1.-2.3"])
def test_anything_else_is_refused(bad):
    with pytest.raises(ValueError):
        parse_event_id(bad)
