"""The ``id:`` of every event of a resumable stream: where in the worker's deltas the client is, so that any gateway
can go on from there (gateway/stream_resume.py).

    id: <request id>.<attempt>.<seq>.<n>    the n-th event made of delta ``seq`` of run ``attempt``

A delta is numbered by the worker that sent it (``TokenDelta.seq`` within its run, ``attempt`` the run: a
continuation after a failover or a hand-over is the next one), so the position means the same to every gateway: one
that takes the stream over is sent the run's deltas again and formats them as the first did, and writes only the
events after the client's. A chat stream's opening events belong to its first delta; the usage event, ``[DONE]`` and
an error event to the last delta seen. No pure function of the client's bytes: positions order as tuples.
"""

from __future__ import annotations

from typing import NamedTuple

from switchyard.shared.messages import TokenDelta


class Position(NamedTuple):
    attempt: int
    seq: int
    n: int


BEFORE_ALL = Position(-1, -1, -1)


def parse_event_id(event_id: str) -> tuple[str, Position]:
    """``(request id, position)`` of a ``Last-Event-ID``; raises ValueError for anything else."""
    request_id, attempt, seq, n = event_id.strip().rsplit(".", 3)
    position = Position(int(attempt), int(seq), int(n))
    if not request_id or min(position) < 0:
        raise ValueError(event_id)
    return request_id, position


class EventIds:
    """Numbers one stream's events as they are made; with ``after``, drops those the client already has."""

    def __init__(self, request_id: str, after: Position = BEFORE_ALL) -> None:
        self._prefix = f"id: {request_id}.".encode()
        self._after = after
        self._delta = (0, 0)
        self._n = 0

    def of_delta(self, delta: TokenDelta, events: list[bytes]) -> list[bytes]:
        """``events``, made of ``delta``, with their ids; the client's already-seen ones left out."""
        self._delta, self._n = (delta.attempt, delta.seq), 0
        return self.more(events)

    def more(self, events: list[bytes]) -> list[bytes]:
        """Events after the last delta's (usage, ``[DONE]``, an error), numbered on from its."""
        out = []
        for event in events:
            position = Position(*self._delta, self._n)
            self._n += 1
            if position > self._after:
                out.append(self._prefix + f"{position.attempt}.{position.seq}.{position.n}\n".encode() + event)
        return out
