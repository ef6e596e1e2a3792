"""Refuse a URL whose path or query holds text Postgres cannot take (U+0000, as ``%00``): 400 naming where, before
any route passes it to a query (an id, a cursor, a date). Bodies are checked field by field (domain/api/text.py);
percent-decoding replaces invalid UTF-8, so a URL can bring no lone surrogate."""

from __future__ import annotations

from urllib.parse import parse_qsl

from switchyard.domain.api.text import UNSTORABLE
from switchyard.gateway.asgi_answers import send_error


def refused_part(scope) -> str | None:
    """``path`` or the name of the first query parameter that holds U+0000 (None: the URL is fine)."""
    if UNSTORABLE.search(scope["path"]):
        return "path"
    query = scope.get("query_string", b"").decode("latin-1")
    if "%00" in query or "\x00" in query:
        for name, value in parse_qsl(query, keep_blank_values=True):
            if UNSTORABLE.search(name) or UNSTORABLE.search(value):
                return name if not UNSTORABLE.search(name) else "query"
        return "query"
    return None


class UrlText:
    """Pure ASGI middleware for every HTTP request."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and (where := refused_part(scope)) is not None:
            return await send_error(send, 400, f"Invalid value for '{where}': it contains U+0000 (NUL), which "
                                    "cannot be stored.", "invalid_value", param=where)
        await self.app(scope, receive, send)
