"""The rate-limit headers admission worked out (``x-ratelimit-*``, gateway/admission.py puts them in the request's
state) on every response of the request: its body or stream, and its error too.

Pure ASGI, not ``@app.middleware("http")``: Starlette runs such a middleware's app in a task of its own and passes
every streamed chunk through a memory channel to it, a hop per token of every stream; here the only work per
response is at its start line.
"""

from __future__ import annotations


class RateLimitHeaders:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = scope.setdefault("state", {})  # the dict behind the handler's ``request.state``

        async def send_with_headers(message) -> None:
            if message["type"] == "http.response.start" and (extra := state.get("rate_headers")):
                present = {name for name, _ in message.get("headers", ())}
                added = [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in extra.items()]
                message = {**message, "headers": [*message.get("headers", ()),
                                                  *(h for h in added if h[0] not in present)]}
            await send(message)

        await self.app(scope, receive, send_with_headers)
