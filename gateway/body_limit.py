"""Refuse a request body over the configured size with 413 before any of it is parsed.

A pure ASGI middleware, so it sees the bytes as they arrive: a declared ``Content-Length`` over the limit is
answered at once, unread; a body sent without one (chunked) is counted as it is read, and once it passes the limit
the application gets an empty rest and whatever it answers is replaced by the 413. File uploads have their own,
larger limit (``files.MAX_FILE_BYTES``), checked here too.
"""

from __future__ import annotations

from switchyard.domain.files import MAX_FILE_BYTES, MULTIPART_SLACK
from switchyard.gateway.asgi_answers import send_error

FILES_PATH = "/v1/files"


class BodySizeLimit:
    """``max_bytes`` for every body but uploads to ``/v1/files``."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def _limit(self, path: str) -> int:
        return MAX_FILE_BYTES + MULTIPART_SLACK if path.startswith(FILES_PATH) else self.max_bytes

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self._limit(scope["path"])
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            return await _too_large(send, limit)
        seen, over = 0, False

        async def counted_receive():
            nonlocal seen, over
            if over:
                return {"type": "http.request", "body": b"", "more_body": False}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    return {"type": "http.request", "body": b"", "more_body": False}
            return message

        answered = False

        async def guarded_send(message):
            nonlocal answered
            if not over:
                return await send(message)
            if not answered:  # the app answered a body it never saw whole: the client gets the 413 instead
                answered = True
                await _too_large(send, limit)

        await self.app(scope, counted_receive, guarded_send)


async def _too_large(send, limit: int) -> None:
    await send_error(send, 413, f"The request body is larger than this server's limit of {limit} bytes.",
                     "request_too_large", close=True)
