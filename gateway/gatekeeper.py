"""Who may send a body at all: every ``/v1`` request's key is checked before a byte of its body is read, and a
client address that keeps failing is refused before its keys are even looked up.

    request ─▶ address over gateway.failed_auth_per_minute failures in the last minute? ─▶ 429, nothing read
            ─▶ Authorization checked (domain/auth.py: cache, then Postgres) ─▶ 401 / 503, body never read
            ─▶ the route, with ``request.state.auth`` set (gateway/admission.py reads it)

The address is the peer's, or, when the peer is one of ``gateway.trusted_proxies`` (a load balancer), the last
address it put in ``X-Forwarded-For``. Failures are counted per gateway, in memory: this throttles guessing, it is
not a quota (a guess has 190 bits to find, domain/tenancy.py).
"""

from __future__ import annotations

import ipaddress
import math
import time
from collections import deque

from switchyard.domain.errors import OpenAIError
from switchyard.gateway.asgi_answers import send_error
from switchyard.shared.tracing import tracer

WINDOW_S = 60.0
MAX_ADDRESSES = 100_000  # tracked at once; beyond, the longest quiet are forgotten
# Addresses whose last failure has left the window count nothing: they are dropped once a window, so an address
# that stopped trying is not held until MAX_ADDRESSES others push it out.


class FailedKeys:
    """Failed authentications per client address over the last minute."""

    def __init__(self, per_minute: int) -> None:
        self._per_minute = per_minute
        self._failures: dict[str, deque[float]] = {}
        self._swept_at = 0.0

    def _recent(self, address: str, now: float) -> deque[float]:
        failures = self._failures.get(address)
        if failures is None:
            return deque()
        while failures and failures[0] <= now - WINDOW_S:
            failures.popleft()
        if not failures:
            del self._failures[address]
        return failures

    def wait_s(self, address: str, now: float | None = None) -> float | None:
        """Seconds until ``address`` may try again, or None when it may now."""
        now = time.monotonic() if now is None else now
        if now - self._swept_at >= WINDOW_S:
            self._forget_quiet(now)
        failures = self._recent(address, now)
        if len(failures) < self._per_minute:
            return None
        return failures[0] + WINDOW_S - now

    def tenant_state(self) -> dict[str, int]:
        return {"failed_auth_addresses": len(self._failures)}

    def _forget_quiet(self, now: float) -> None:
        self._swept_at = now
        for address in [a for a, failures in self._failures.items() if failures[-1] <= now - WINDOW_S]:
            del self._failures[address]

    def failed(self, address: str, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        if address not in self._failures and len(self._failures) >= MAX_ADDRESSES:
            for quiet in sorted(self._failures, key=lambda a: self._failures[a][-1])[:MAX_ADDRESSES // 10]:
                del self._failures[quiet]
        self._failures.setdefault(address, deque()).append(now)


def client_address(scope, trusted: list) -> str:
    """The client's address: the peer's, or the last forwarded one when the peer is a trusted proxy."""
    peer = (scope.get("client") or ("unknown", 0))[0]
    try:
        if trusted and any(ipaddress.ip_address(peer) in net for net in trusted):
            forwarded = dict(scope["headers"]).get(b"x-forwarded-for", b"").decode("latin-1")
            if forwarded.strip():
                return forwarded.split(",")[-1].strip()
    except ValueError:  # a peer that is not an IP address (a Unix socket): taken as it is
        pass
    return peer


class Gatekeeper:
    """Pure ASGI middleware over ``/v1``; ``services`` gives the authenticator once the gateway has started."""

    def __init__(self, app, services, per_minute: int, trusted_proxies: list[str]) -> None:
        self.app = app
        self._services = services
        self._failures = FailedKeys(per_minute)
        services.metrics.tenant_state.watch("gatekeeper", self._failures.tenant_state)
        self._trusted = [ipaddress.ip_network(n, strict=False) for n in trusted_proxies]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        address = client_address(scope, self._trusted)
        wait_s = self._failures.wait_s(address)
        if wait_s is not None:
            self._services.metrics.error(None, None, 429, "too_many_failed_keys")
            return await send_error(send, 429, "Too many requests with a wrong API key from your address; try again "
                                    "later.", "too_many_failed_keys", type="rate_limit_error",
                                    headers={"Retry-After": str(max(1, math.ceil(wait_s)))}, close=True)
        headers = dict(scope["headers"])
        try:
            with tracer.start_as_current_span("authenticate"):
                auth = await self._services.authenticator.authenticate(
                    headers.get(b"authorization", b"").decode("latin-1"))
        except OpenAIError as exc:
            if exc.status == 401:
                self._failures.failed(address)
            self._services.metrics.error(None, None, exc.status, exc.code)
            # The body is never read nor parsed: the connection closes rather than wait for the rest of it.
            return await send_error(send, exc.status, exc.message, exc.code or "", type=exc.type,
                                    headers=exc.headers, close=_has_body(headers))
        scope.setdefault("state", {})["auth"] = auth
        await self.app(scope, receive, send)


def _has_body(headers: dict[bytes, bytes]) -> bool:
    return headers.get(b"content-length", b"0") not in (b"", b"0") or b"transfer-encoding" in headers
