"""A streamed answer over plain ASGI callables, no server: a client that leaves, or stops reading, ends it and runs
its body's way out at once; one that reads gets every chunk; the server stopping is not swallowed."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.gateway.client_watch import BoundedStream, passing_stream_starts


class Body:
    """An endless body, a chunk per ``every_s``, that records whether its way out ran."""

    def __init__(self, chunks: int | None = None, every_s: float = 0.01) -> None:
        self.chunks, self.every_s, self.closed = chunks, every_s, False

    async def __call__(self):
        try:
            n = 0
            while self.chunks is None or n < self.chunks:
                await asyncio.sleep(self.every_s)
                yield f"data: {n}\n\n"
                n += 1
        finally:
            self.closed = True


def stream(body: Body, send_timeout_s: float = 5.0, buffered=lambda: 0, max_buffered: int = 1 << 20):
    return BoundedStream(body(), send_timeout_s=send_timeout_s, max_buffered_bytes=max_buffered, buffered=buffered,
                         media_type="text/event-stream")


async def never_leaves():
    await asyncio.Event().wait()
    return {"type": "http.disconnect"}


async def test_a_client_that_reads_gets_every_chunk_and_the_end():
    sent: list[dict] = []

    async def send(message):
        sent.append(message)

    body = Body(chunks=5)
    await asyncio.wait_for(stream(body)({"type": "http"}, never_leaves, send), 10)
    assert [m["type"] for m in sent] == ["http.response.start"] + ["http.response.body"] * 6
    assert b"".join(m["body"] for m in sent[1:]) == b"".join(f"data: {n}\n\n".encode() for n in range(5))
    assert sent[-1]["more_body"] is False and body.closed


async def test_a_streams_chunks_go_straight_to_the_server_and_its_start_and_end_through_the_middlewares():
    at_server: list[dict] = []
    seen_by_middleware: list[dict] = []

    async def server_send(message):
        at_server.append(message)

    async def middleware_send(message):  # a middleware's wrapper, as the rate-limit headers' is
        seen_by_middleware.append(message)
        await outer(message)

    scope = {"type": "http"}
    outer = passing_stream_starts(scope, server_send)  # the app's outermost layer (gateway/app.py)
    await asyncio.wait_for(stream(Body(chunks=5))(scope, never_leaves, middleware_send), 10)
    assert [m.get("more_body") for m in at_server] == [None, True, True, True, True, True, False]
    assert all(set(m) <= {"type", "status", "headers", "body", "more_body"} for m in at_server)  # no marker left
    assert [m["type"] for m in seen_by_middleware] == ["http.response.start", "http.response.body"]
    assert seen_by_middleware[-1]["more_body"] is False


async def test_a_stream_whose_start_a_middleware_answered_instead_writes_nothing_past_that_answer():
    at_server: list[dict] = []

    async def server_send(message):
        at_server.append(message)

    answered = False

    async def refusing_send(message):  # as the body limit's wrapper answers a refused body with a 413
        nonlocal answered
        if not answered:
            answered = True
            await outer({"type": "http.response.start", "status": 413, "headers": []})
            await outer({"type": "http.response.body", "body": b"too large", "more_body": False})

    scope = {"type": "http"}
    outer = passing_stream_starts(scope, server_send)
    await asyncio.wait_for(stream(Body(chunks=3))(scope, never_leaves, refusing_send), 10)
    assert [m.get("status") for m in at_server] == [413, None] and at_server[-1]["body"] == b"too large"


async def test_a_client_that_leaves_ends_the_stream_and_its_body_runs_its_way_out():
    left = asyncio.Event()
    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if len(sent) == 4:
            left.set()

    async def receive():
        await left.wait()
        return {"type": "http.disconnect"}

    body = Body()
    await asyncio.wait_for(stream(body)({"type": "http"}, receive, send), 10)  # returns: no error for the server
    assert body.closed and sent[-1]["more_body"] is True  # left unfinished: the server closes the connection


@pytest.mark.parametrize("bound", ["time", "bytes"])
async def test_a_client_that_stops_reading_is_ended_within_its_bounds(bound):
    sent: list[dict] = []

    async def send(message):
        sent.append(message)
        if len(sent) == 3:  # the connection's buffer is full: this send never returns
            await asyncio.Event().wait()

    body = Body()
    waiting = (lambda: 10_000) if bound == "bytes" else (lambda: 0)
    response = stream(body, send_timeout_s=0.5 if bound == "time" else 60, buffered=waiting, max_buffered=1_000)
    loop = asyncio.get_running_loop()
    started = loop.time()
    await asyncio.wait_for(response({"type": "http"}, never_leaves, send), 10)
    # Ended by the bound, well before the 60 s send timeout where bytes are the bound; the body's way out ran.
    assert body.closed and len(sent) == 3 and loop.time() - started < 5


async def test_the_server_stopping_still_cancels_the_request():
    streaming = asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            streaming.set()

    body = Body()
    task = asyncio.ensure_future(stream(body)({"type": "http"}, never_leaves, send))
    await asyncio.wait_for(streaming.wait(), 10)  # cancelled mid-stream, as a stopping server cancels it
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert body.closed
