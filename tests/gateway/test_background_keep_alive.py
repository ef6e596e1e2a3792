"""A background (or streamed) response's run keeps its row alive, and stops itself once the row is closed under it
(failed by housekeeping while its gateway stalled, or cancelled): nobody will read what it would go on making."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from switchyard.gateway import responses_service
from switchyard.gateway.responses_service import ResponseService
from switchyard.shared import subjects


class _Rows:
    def __init__(self, open_for: int) -> None:
        self.open_for, self.touched = open_for, 0

    async def touch(self, _response_id: str) -> bool:
        self.touched += 1
        if self.touched == 2:
            raise ConnectionError("Postgres away")  # a failed touch says nothing: the run goes on
        return self.touched <= self.open_for


RUN = SimpleNamespace(response_id="resp_1", request=SimpleNamespace(request_id="req-1"))


class _NATS:
    is_connected = True

    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, subject: str, _payload: bytes) -> None:
        self.published.append(subject)


async def test_a_run_whose_response_was_closed_cancels_its_request(monkeypatch):
    monkeypatch.setattr(responses_service, "ALIVE_EVERY_S", 0.001)
    rows, nc = _Rows(open_for=3), _NATS()
    service = ResponseService(None, rows, None, None, nc, None)  # type: ignore[arg-type]
    await asyncio.wait_for(service._keep_alive(RUN), 5)  # type: ignore[arg-type]
    assert rows.touched == 4  # open, unknown, open, closed
    assert nc.published == [subjects.cancel_subject("req-1")]


async def test_an_open_response_is_only_touched(monkeypatch):
    monkeypatch.setattr(responses_service, "ALIVE_EVERY_S", 0.001)
    rows, nc = _Rows(open_for=10**9), _NATS()
    service = ResponseService(None, rows, None, None, nc, None)  # type: ignore[arg-type]
    alive = asyncio.create_task(service._keep_alive(RUN))  # type: ignore[arg-type]
    while rows.touched < 5 and not alive.done():
        await asyncio.sleep(0.001)
    assert not alive.done()
    alive.cancel()
    assert nc.published == []


async def test_a_run_taken_over_touches_its_row_at_once(monkeypatch):
    monkeypatch.setattr(responses_service, "ALIVE_EVERY_S", 3600)
    rows, nc = _Rows(open_for=0), _NATS()  # closed before the run took it over: its worker is stopped at once
    service = ResponseService(None, rows, None, None, nc, None)  # type: ignore[arg-type]
    await asyncio.wait_for(service._keep_alive(RUN, touch_now=True), 5)  # type: ignore[arg-type]
    assert rows.touched == 1 and nc.published == [subjects.cancel_subject("req-1")]
