"""A gateway's graceful stop: on SIGTERM it reports not-ready, finishes what it is answering, then exits.

    SIGTERM ─▶ /readyz 503 (load balancers stop sending) ─▶ open requests and streams run to their end, new ones
            are still served ─▶ none open, or ``drain_timeout_s`` passed ─▶ uvicorn's own shutdown
    a second SIGTERM/SIGINT exits at once

``InFlight`` counts the requests being answered (health checks aside); ``DrainingServer`` is uvicorn's server with
that first step put in front of its shutdown.
"""

from __future__ import annotations

import asyncio
import logging

import uvicorn

log = logging.getLogger("switchyard.gateway")

_HEALTH_PATHS = ("/readyz", "/healthz")


class InFlightCounter:
    """How many requests the gateway is answering now."""

    def __init__(self) -> None:
        self.count = 0
        self._changed = asyncio.Condition()

    async def wait_idle(self, timeout_s: float) -> bool:
        """True once none is open; False when ``timeout_s`` passed first."""
        async def idle() -> None:
            async with self._changed:
                await self._changed.wait_for(lambda: self.count == 0)

        try:
            await asyncio.wait_for(idle(), timeout_s)
            return True
        except TimeoutError:
            return False

    async def add(self, n: int) -> None:
        """``n`` more requests open (negative: ended)."""
        async with self._changed:
            self.count += n
            self._changed.notify_all()


class CountInFlight:
    """ASGI middleware: counts each HTTP request (a stream until its last byte) in ``counter``."""

    def __init__(self, app, counter: InFlightCounter) -> None:
        self.app = app
        self.counter = counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in _HEALTH_PATHS:
            return await self.app(scope, receive, send)
        await self.counter.add(1)
        try:
            await self.app(scope, receive, send)
        finally:
            await self.counter.add(-1)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, draining first: see the module docstring. ``state`` has the ``draining`` flag /readyz
    reads (the gateway's services)."""

    def __init__(self, config: uvicorn.Config, state, counter: InFlightCounter, drain_timeout_s: float) -> None:
        super().__init__(config)
        self._state, self._counter, self._drain_timeout_s = state, counter, drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self._loop is None or getattr(self._state, "draining", False):
            return super().handle_exit(sig, frame)  # not serving yet, or a second signal: stop now
        self._state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.get_running_loop().create_task(self._drain())  # called on the serving loop

    async def _drain(self) -> None:
        log.info("draining: /readyz answers 503; waiting up to %.0f s for %d open requests",
                 self._drain_timeout_s, self._counter.count)
        if not await self._counter.wait_idle(self._drain_timeout_s):
            log.warning("drain deadline passed with %d requests open: stopping anyway", self._counter.count)
        self.should_exit = True
