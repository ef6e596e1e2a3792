"""OpenAI-shaped answers sent by the pure ASGI middleware that refuse a request before any route sees it (its size,
its URL, its key, its pace), in the shape gateway/errors.py gives every other error."""

from __future__ import annotations

import json


async def send_error(send, status: int, message: str, code: str, *, param: str | None = None,
                     type: str = "invalid_request_error", headers: dict[str, str] | None = None,
                     close: bool = False) -> None:
    """Answer ``status`` with ``{"error": {...}}``; ``close``: the connection closes after it (a body left unread,
    or a client being pushed off)."""
    body = json.dumps({"error": {"message": message, "type": type, "param": param, "code": code}}).encode()
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(name.lower().encode(), value.encode()) for name, value in (headers or {}).items()]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})
