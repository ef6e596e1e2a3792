"""Each API request's id, minted where the request enters the gateway.

The id names the request everywhere: the ``X-Request-Id`` header of its answer (an error's too:
gateway/errors.py), the wire request and its NATS subjects, usage rows, and every log line written while it is
served (JSON logs carry ``request_id``, shared/logs.py). Setting it in the outermost middleware puts it in the
context of everything below, uvicorn's access line included, and of any task started for the request.
"""

from __future__ import annotations

import uuid

from switchyard.shared.logs import request_id_var


def served_request_id() -> str | None:
    """The id of the ``/v1`` request being served; None outside one."""
    return request_id_var.get()


def current_request_id() -> str:
    """The id of the request being served (a fresh one outside a request: a batch line, a test)."""
    return served_request_id() or uuid.uuid4().hex


class RequestIds:
    """Pure ASGI middleware: a new id per ``/v1`` request, in ``request_id_var`` for the request's lifetime."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        token = request_id_var.set(uuid.uuid4().hex)
        try:
            await self.app(scope, receive, send)
        finally:
            request_id_var.reset(token)
