"""Which gateway process answered: every response names it (``x-switchyard-gateway: <host>:<pid>``), so an operator
can tell which one to drain or look at, and a client which one its stream went through.

The host is the machine's (a Kubernetes pod's) name, what an operator drains; the pid tells apart the processes of
one host (``gateway.processes`` share a port). Pure ASGI, as rate_headers.py says why: the only work per response
is at its start line.
"""

from __future__ import annotations

import os
import socket

HEADER = "x-switchyard-gateway"


def gateway_identity() -> str:
    """This process's name in the header: ``<host>:<pid>``."""
    return f"{socket.gethostname()}:{os.getpid()}"


class GatewayIdentity:
    """Adds ``HEADER`` to every HTTP response of the app it wraps."""

    def __init__(self, app) -> None:
        self.app = app
        self._header = (HEADER.encode("latin-1"), gateway_identity().encode("latin-1"))

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_identity(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self._header]}
            await send(message)

        await self.app(scope, receive, send_with_identity)
