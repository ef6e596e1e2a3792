"""What the bodies a gateway refuses may cost it, per key: the bytes of every ``/v1`` body read and then answered
with a 4xx count against the key's budget for the last minute (``gateway.refused_body_bytes_per_minute``, 16 MiB);
a key over it gets 429 ``too_many_refused_bodies`` with ``Retry-After`` before its next body is read.

    request (its key known: gateway/gatekeeper.py) ─▶ key over its budget? ─▶ 429 after a 1 s pause, body never
                                                                              read
                                                   ─▶ the app; its body bytes counted as they are read
    answered 4xx ─▶ those bytes added to the key's last minute

Why: a body cost the gateway its reading and decoding before it could be refused (about 7 ms of the event loop for
500 KB of JSON), every other request on the gateway waits while it does, and nothing refused is billed or counted
by the rate limits (they count what is admitted). Six loops sending 15,000-message chats back to back held the
loop as long as they liked: another tenant's TTFT went from 13 to over 200 ms. A client's refusals are rare; one
that keeps sending what is refused is told to wait, and the others are untouched. Counted per gateway, in memory,
as wrong keys are: it bounds what one key costs each gateway, it is not a quota.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque

from switchyard.gateway.asgi_answers import send_error

WINDOW_S = 60.0
PAUSE_S = 1.0
MAX_KEYS = 100_000  # tracked at once; beyond, the longest quiet are forgotten
# Keys whose last refusal has left the window count nothing: they are dropped once a window (a scan of the keys
# refused in the last minutes), so a key that stopped calling is not held until MAX_KEYS others push it out.


class RefusedBytes:
    """The bytes of refused bodies per key over the last minute."""

    def __init__(self, per_minute: int) -> None:
        self._per_minute = per_minute
        self._refused: dict[str, deque[tuple[float, int]]] = {}
        self._sums: dict[str, int] = {}
        self._swept_at = 0.0

    def _recent(self, key: str, now: float) -> int:
        refused = self._refused.get(key)
        if refused is None:
            return 0
        while refused and refused[0][0] <= now - WINDOW_S:
            self._sums[key] -= refused.popleft()[1]
        if not refused:
            del self._refused[key], self._sums[key]
            return 0
        return self._sums[key]

    def wait_s(self, key: str, now: float | None = None) -> float | None:
        """Seconds until ``key``'s budget has room again, or None when it has now."""
        now = time.monotonic() if now is None else now
        if now - self._swept_at >= WINDOW_S:
            self._forget_quiet(now)
        if self._recent(key, now) < self._per_minute:
            return None
        refused = self._refused[key]
        # The oldest refusals leave the window first: wait until enough of them have to bring it under.
        total = self._sums[key]
        for at, size in refused:
            total -= size
            if total < self._per_minute:
                return at + WINDOW_S - now
        return WINDOW_S

    def tenant_state(self) -> dict[str, int]:
        return {"refused_body_keys": len(self._refused)}

    def _forget_quiet(self, now: float) -> None:
        self._swept_at = now
        for key in [k for k, refused in self._refused.items() if refused[-1][0] <= now - WINDOW_S]:
            del self._refused[key], self._sums[key]

    def refused(self, key: str, size: int, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if key not in self._refused and len(self._refused) >= MAX_KEYS:
            for quiet in sorted(self._refused, key=lambda k: self._refused[k][-1][0])[:MAX_KEYS // 10]:
                del self._refused[quiet], self._sums[quiet]
        self._refused.setdefault(key, deque()).append((now, size))
        self._sums[key] = self._sums.get(key, 0) + size


class RefusedBodies:
    """Pure ASGI middleware inside the gatekeeper (it needs the caller's key); ``metrics`` counts its refusals."""

    def __init__(self, app, per_minute: int, metrics) -> None:
        self.app = app
        self._budget = RefusedBytes(per_minute)
        self._metrics = metrics
        metrics.tenant_state.watch("refused_bodies", self._budget.tenant_state)

    async def __call__(self, scope, receive, send) -> None:
        auth = scope.get("state", {}).get("auth") if scope["type"] == "http" else None
        if auth is None:
            return await self.app(scope, receive, send)
        wait_s = self._budget.wait_s(auth.key_id)
        if wait_s is not None:
            self._metrics.error(None, None, 429, "too_many_refused_bodies")
            # Answered after a pause that costs this gateway nothing (a sleeping task): a client that sends on
            # regardless of Retry-After is slowed to a request a second per connection, not answered as fast as
            # it can ask.
            await asyncio.sleep(min(wait_s, PAUSE_S))
            return await send_error(send, 429, "Too many of this key's requests were refused in the last minute; "
                                    "fix them before sending more.", "too_many_refused_bodies",
                                    type="rate_limit_error", headers={"Retry-After": str(max(1, math.ceil(wait_s)))},
                                    close=True)
        read, status = 0, 0

        async def counted_receive():
            nonlocal read
            message = await receive()
            if message["type"] == "http.request":
                read += len(message.get("body", b""))
            return message

        async def watched_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, counted_receive, watched_send)
        finally:
            if 400 <= status < 500 and read:
                self._budget.refused(auth.key_id, read)
