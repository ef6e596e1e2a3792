"""Refuse a request body over the configured size (413) or slower than its deadline (408), before any of it is
parsed.

A pure ASGI middleware, so it sees the bytes as they arrive: a declared ``Content-Length`` over the limit is
answered at once, unread; a body sent without one (chunked) is counted as it is read, and once it passes the limit
the application gets an empty rest and whatever it answers is replaced by the 413. A body must arrive whole within
``timeout_s`` of its first read (``upload_timeout_s`` for file uploads): a client trickling a byte every few
seconds holds a connection that long at most, and then gets a 408. File uploads have their own, larger size
limit (``files.MAX_FILE_BYTES``), checked here too. It runs after the key was checked (gateway/gatekeeper.py).
"""

from __future__ import annotations

import asyncio
import time

from switchyard.domain.files import MAX_FILE_BYTES, MULTIPART_SLACK
from switchyard.gateway.asgi_answers import send_error

FILES_PATH = "/v1/files"


class BodySizeLimit:
    """``max_bytes`` and ``timeout_s`` for every body but uploads to ``/v1/files`` (their own limits)."""

    def __init__(self, app, max_bytes: int, timeout_s: float = 30.0, upload_timeout_s: float = 300.0) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s
        self.upload_timeout_s = upload_timeout_s

    def _limits(self, path: str) -> tuple[int, float]:
        if path.startswith(FILES_PATH):
            return MAX_FILE_BYTES + MULTIPART_SLACK, self.upload_timeout_s
        return self.max_bytes, self.timeout_s

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit, timeout_s = self._limits(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await _too_large(send, limit)
        seen, refused, whole, deadline = 0, None, False, None
        end = {"type": "http.request", "body": b"", "more_body": False}

        async def counted_receive():
            nonlocal seen, refused, whole, deadline
            if refused is not None:
                return end
            if whole:  # the body is in: what comes now is the disconnect (gateway/client_watch.py waits for it)
                return await receive()
            deadline = deadline or time.monotonic() + timeout_s
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                refused = "time"
                return end
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                whole = not message.get("more_body", False)
                if seen > limit:
                    refused = "size"
                    return end
            return message

        answered = False

        async def guarded_send(message):
            nonlocal answered
            if refused is None:
                return await send(message)
            if not answered:  # the app answered a body it never saw whole: the client gets the refusal instead
                answered = True
                if refused == "size":
                    await _too_large(send, limit)
                else:
                    await send_error(send, 408, f"The request body did not arrive within {timeout_s:g} seconds.",
                                     "request_timeout", close=True)

        await self.app(scope, counted_receive, guarded_send)


async def _too_large(send, limit: int) -> None:
    await send_error(send, 413, f"The request body is larger than this server's limit of {limit} bytes.",
                     "request_too_large", close=True)
