"""The client's side of an answer: whether it is still there, and whether it keeps up. Work nobody waits for is
stopped, and nothing is buffered for a reader without bound.

    not streamed   the request waits for its worker and its tokens while ``until_gone`` listens for the client's
                   disconnect (a client timeout, a closed connection): gone, and the worker is told to stop, as
                   vLLM's server aborts a request whose client left
    streamed       each chunk must be taken by the client within ``send_timeout_s``, and the deltas waiting behind
                   it may not pass ``max_buffered_bytes``: a reader that falls further behind has its stream ended
                   and its work stopped (``BoundedStream``)

A stream's chunks between its start line and its end go to the server's own ``send``, not down the app's chain of
middleware wrappers (Starlette's error handlers, the rate-limit headers, the body limit, ...): each wrapper is a
coroutine per chunk, and the whole chain costs more than the server's own write. Its start line and its end still
pass the whole chain, so everything that watches a response (started or not, its headers, its end) sees it; no
middleware here rewrites a body, and one that did would not see a stream's chunks. ``passing_stream_starts``, the
app's outermost layer, hands the server's ``send`` over once the stream's own start line has reached it, so a stream
whose start was replaced on the way (an error answered instead) never writes past it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import TypeVar, cast

from fastapi import Request
from fastapi.responses import StreamingResponse

log = logging.getLogger("switchyard.gateway")

T = TypeVar("T")
SERVER_SEND = "switchyard.server_send"  # in a streamed request's scope, once its start line reached the server
_STREAM_START = "switchyard.stream_start"  # marks a BoundedStream's own start line on its way down the chain
_POLL_S = 0.25  # how often a chunk the client has not taken yet checks the bytes waiting behind it
_CLIENT_LEFT = "the client left"  # why a stream was ended, when it was not for being too slow


class ClientGone(Exception):
    """The client went away before its answer was ready."""


def until_gone(request: Request) -> Callable[[], Awaitable[None]]:
    """A waiter that returns once ``request``'s client has disconnected. Only for after the body was read: it
    takes the connection's next ASGI messages, and once the body is in, the only one left is the disconnect."""
    return lambda: _until_disconnect(request.receive)


async def unless_gone(work: Awaitable[T], gone: Callable[[], Awaitable[None]] | None) -> T:
    """``await work``, or raise ``ClientGone`` (``work`` cancelled) as soon as ``gone()`` returns."""
    if gone is None:
        return await work
    task, watcher = asyncio.ensure_future(work), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(BaseException):
        await task
    raise ClientGone


def passing_stream_starts(scope, send):
    """``send`` as the app's outermost layer hands it down: when a ``BoundedStream``'s own start line reaches it,
    the server's ``send`` goes in ``scope`` (``SERVER_SEND``) for that stream's chunks."""
    async def send_through(message) -> None:
        if message.get(_STREAM_START):
            message = {k: v for k, v in message.items() if k != _STREAM_START}
            scope[SERVER_SEND] = send
        await send(message)
    return send_through


class BoundedStream(StreamingResponse):
    """A stream whose client must keep up: a chunk not taken within ``send_timeout_s``, or deltas waiting behind it
    over ``max_buffered_bytes`` (``buffered()`` counts them), ends the stream. Its body iterator is closed then,
    as when the client leaves, so whatever it does on the way out (the worker told to stop, the ticket settled)
    runs at once.

    Starlette's ``StreamingResponse`` runs each stream in a task group of two tasks (the body, and a listener for
    the disconnect), and a send timeout made of a task per chunk adds a task per token: at thousands of open
    streams, a hundred objects each for the garbage collector to walk (shared/gc_pauses.py). Here one task sends
    the body: not the request's own, whose stack holds the thirty-odd coroutines of the app's middlewares and
    routing, every one of which each wake-up for a token would resume, but one of its own a few frames deep,
    which the request's task awaits. One task listens for the disconnect, and a timer, armed while a send is out,
    checks the bounds every ``_POLL_S``. Either ends the stream by cancelling the body's task."""

    def __init__(self, content, *, send_timeout_s: float, max_buffered_bytes: int, buffered: Callable[[], int],
                 **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._send_timeout_s = send_timeout_s
        self._max_buffered_bytes = max_buffered_bytes
        self._buffered = buffered
        self._task: asyncio.Task | None = None  # the one sending the body
        self._scope: dict = {}
        self._loop: asyncio.AbstractEventLoop  # its loop, set by __call__ (read once, not per chunk)
        self._streaming = False  # the body is being sent: only then may the stream be ended from outside it
        self._ended_by: str | None = None  # why it was ended from outside: the client left, or is too slow
        self._sending_since: float | None = None  # when the send now out began (the loop's clock)
        self._watchdog: asyncio.TimerHandle | None = None

    async def __call__(self, scope, receive, send) -> None:
        self._loop = asyncio.get_running_loop()
        if scope["type"] != "http":
            return await super().__call__(scope, receive, send)
        self._scope = scope
        listening = asyncio.ensure_future(_until_disconnect(receive))
        listening.add_done_callback(self._client_left)
        self._streaming = True
        # Cancelling this task (the server stopping) cancels the body's task too: it is what this one awaits.
        self._task = self._loop.create_task(self.stream_response(send))
        try:
            await self._task
        except asyncio.CancelledError:
            current = asyncio.current_task()  # the request's: this coroutine always runs in a task
            if self._ended_by is None or (current is not None and current.cancelling()):
                raise  # cancelled by someone else: the server stopping
        except OSError:  # a server on ASGI 2.4 says so when the client left
            self._ended_by = _CLIENT_LEFT
        finally:
            self._streaming = False
            listening.remove_done_callback(self._client_left)
            listening.cancel()
            if self._watchdog is not None:
                self._watchdog.cancel()
        if self._ended_by is not None:
            if self._ended_by is not _CLIENT_LEFT:
                log.warning("ending a stream whose client stopped reading (%s)", self._ended_by)
            # Its way out now (the worker told to stop); the response is left unfinished, so the server closes
            # the connection.
            # Starlette makes every body an async generator (a plain iterator runs through iterate_in_threadpool).
            await cast(AsyncGenerator, self.body_iterator).aclose()

    def _end(self, why: str) -> None:
        if self._streaming and self._ended_by is None and self._task is not None:
            self._ended_by = why
            self._task.cancel()

    def _client_left(self, listening: asyncio.Future) -> None:
        if not listening.cancelled():
            self._end(_CLIENT_LEFT)

    async def stream_response(self, send) -> None:
        await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                "headers": self.raw_headers, _STREAM_START: True})
        direct = self._scope.get(SERVER_SEND, send)  # see the module docstring
        async for chunk in self.body_iterator:
            if not isinstance(chunk, bytes | memoryview):
                chunk = chunk.encode(self.charset)
            await self._send(direct, {"type": "http.response.body", "body": chunk, "more_body": True})
        await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})

    async def _send(self, send, message: dict) -> None:
        self._sending_since = self._loop.time()
        if self._watchdog is None:
            self._watchdog = self._loop.call_later(_POLL_S, self._watch)
        await send(message)  # returns at once unless the connection's buffer is full
        self._sending_since = None

    def _watch(self) -> None:
        """Every ``_POLL_S`` while a send is out: is it out too long, or is too much waiting behind it?"""
        self._watchdog = None
        if self._sending_since is None or not self._streaming:
            return  # nothing out: the next send arms it again
        if self._loop.time() - self._sending_since >= self._send_timeout_s:
            self._end(f"a chunk not taken in {self._send_timeout_s:g} s")
        elif (queued := self._buffered()) > self._max_buffered_bytes:
            self._end(f"{queued} bytes waiting behind a chunk not taken")
        else:
            self._watchdog = self._loop.call_later(_POLL_S, self._watch)


async def _until_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
