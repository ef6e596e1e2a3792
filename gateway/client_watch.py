"""The client's side of an answer: whether it is still there, and whether it keeps up. Work nobody waits for is
stopped, and nothing is buffered for a reader without bound.

    not streamed   the request waits for its worker and its tokens while ``until_gone`` listens for the client's
                   disconnect (a client timeout, a closed connection): gone, and the worker is told to stop, as
                   vLLM's server aborts a request whose client left
    streamed       each chunk must be taken by the client within ``send_timeout_s``, and the deltas waiting behind
                   it may not pass ``max_buffered_bytes``: a reader that falls further behind has its stream ended
                   and its work stopped (``BoundedStream``)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

log = logging.getLogger("switchyard.gateway")

T = TypeVar("T")
_POLL_S = 0.25  # how often a chunk the client has not taken yet checks the bytes waiting behind it


class ClientGone(Exception):
    """The client went away before its answer was ready."""


def until_gone(request: Request) -> Callable[[], Awaitable[None]]:
    """A waiter that returns once ``request``'s client has disconnected. Only for after the body was read: it
    takes the connection's next ASGI messages, and once the body is in, the only one left is the disconnect."""

    async def wait() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    return wait


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


class SlowReader(Exception):
    """The client stopped taking the stream: ``why`` says by how much."""


class BoundedStream(StreamingResponse):
    """A stream whose client must keep up: a chunk not taken within ``send_timeout_s``, or deltas waiting behind it
    over ``max_buffered_bytes`` (``buffered()`` counts them), ends the stream. Its body iterator is closed then,
    so whatever it does on the way out (the worker told to stop, the ticket settled) runs at once."""

    def __init__(self, content, *, send_timeout_s: float, max_buffered_bytes: int, buffered: Callable[[], int],
                 **kwargs) -> None:
        super().__init__(content, **kwargs)
        self._send_timeout_s = send_timeout_s
        self._max_buffered_bytes = max_buffered_bytes
        self._buffered = buffered

    async def stream_response(self, send) -> None:
        try:
            await self._send(send, {"type": "http.response.start", "status": self.status_code,
                                    "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                if not isinstance(chunk, bytes | memoryview):
                    chunk = chunk.encode(self.charset)
                await self._send(send, {"type": "http.response.body", "body": chunk, "more_body": True})
            await self._send(send, {"type": "http.response.body", "body": b"", "more_body": False})
        except SlowReader as exc:
            log.warning("ending a stream whose client stopped reading (%s)", exc)
            await self.body_iterator.aclose()  # its cleanup now: the connection is then closed unfinished

    async def _send(self, send, message: dict) -> None:
        sending = asyncio.ensure_future(send(message))
        waited = 0.0
        try:
            while True:
                done, _ = await asyncio.wait({sending}, timeout=_POLL_S)
                if done:
                    return sending.result()
                waited += _POLL_S
                if waited >= self._send_timeout_s:
                    raise SlowReader(f"a chunk not taken in {self._send_timeout_s:g} s")
                if (queued := self._buffered()) > self._max_buffered_bytes:
                    raise SlowReader(f"{queued} bytes waiting behind a chunk not taken")
        finally:
            if not sending.done():
                sending.cancel()
