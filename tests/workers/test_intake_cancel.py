"""A cancel addressed to one worker's run (workers/service/intake.py, ``<worker id>[:<attempt>]``): the gateway
dismissed that run and continued the request. A worker back from a stall may have pulled the continuation (the
next attempt, the same request id) before it reads the cancel of its old run: the continuation must go on."""

from __future__ import annotations

import time
from types import SimpleNamespace

import msgspec
import pytest

from switchyard.shared.messages import ChatMessage, GenerateRequest, Resume, SamplingParams
from switchyard.shared.subjects import cancel_subject
from switchyard.workers.service.held import HeldRequests, Tracked
from switchyard.workers.service.intake import Intake


class StubConnection:
    def new_inbox(self) -> str:
        return "_INBOX.test"


class StubPublisher:
    def __init__(self) -> None:
        self.dropped: list[str] = []

    def drop_stream(self, request: GenerateRequest) -> None:
        self.dropped.append(request.request_id)


def _request(attempt: int) -> GenerateRequest:
    now = time.time()
    request = GenerateRequest("r", "m", "pro", SamplingParams(max_tokens=8), now, now + 60,
                              messages=[ChatMessage(role="user", content="hi")], tenant_id="t")
    return request if not attempt else msgspec.structs.replace(request, resume=Resume([5, 6], 4, attempt, 0))


async def _cancel(where: str, attempt: int, data: bytes) -> tuple[HeldRequests, Tracked, StubPublisher]:
    """``data`` sent to a worker holding attempt ``attempt`` of request r ``where`` (pending or active)."""
    held, out = HeldRequests(), StubPublisher()
    tracked = Tracked(_request(attempt), received_at=time.time())
    if where == "active":
        held.active["r"] = tracked
    else:
        held.pending.append((tracked, None))  # type: ignore[arg-type]
    intake = Intake(None, StubConnection(), None, "m", "w", held=held, capacity=None, out=out)
    try:
        await intake.on_cancel(SimpleNamespace(subject=cancel_subject("r"), data=data))
    finally:
        intake.shutdown()
    return held, tracked, out


@pytest.mark.parametrize("where", ["pending", "active"])
async def test_the_cancel_of_a_dismissed_attempt_leaves_the_continuation_held_here_running(where):
    held, tracked, out = await _cancel(where, attempt=1, data=b"w:0")
    assert not held.aborts and not tracked.superseded and not out.dropped


@pytest.mark.parametrize("where", ["pending", "active"])
async def test_the_cancel_of_the_attempt_held_here_stops_it_unbilled(where):
    held, tracked, out = await _cancel(where, attempt=0, data=b"w:0")
    assert "r" in held.aborts
    assert (tracked.superseded, out.dropped) == ((True, ["r"]) if where == "active" else (False, []))


async def test_a_cancel_addressed_to_another_worker_is_ignored_and_one_to_this_worker_stops_any_attempt():
    held, _, _ = await _cancel("active", attempt=1, data=b"other:1")
    assert not held.aborts
    held, tracked, _ = await _cancel("active", attempt=1, data=b"w")
    assert "r" in held.aborts and tracked.superseded
