"""One read at a time of a cached value that many callers want at once (Go's ``singleflight``).

    cache expired ─▶ caller 1: no read running for the key → starts it ──────────┐
                     caller 2..n: one is running → wait for it                    ├─▶ every caller gets its answer
                                                                                   ┘   (or its exception)

A cache read on the request path (a key's tenant, the tier policies, the live workers) that expires in the middle
of a burst would otherwise be read again by every request that arrives before the first read returns: with a
thousand requests waiting on one event loop that is hundreds of reads (hundreds of NATS or Postgres round trips,
each decoded), all for the same answer, taking the CPU the burst itself needs (bench/burst.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from typing import Generic, TypeVar

T = TypeVar("T")


class SingleFlight(Generic[T]):
    def __init__(self) -> None:
        self._running: dict[Hashable, asyncio.Future[T]] = {}

    async def run(self, key: Hashable, read: Callable[[], Awaitable[T]]) -> T:
        """``await read()``, or the answer of the read already running for ``key``. A caller cancelled while it
        waits leaves the read running for the others."""
        future = self._running.get(key)
        if future is None:
            future = self._running[key] = asyncio.ensure_future(read())
            future.add_done_callback(lambda done: self._finished(key, done))
        return await asyncio.shield(future)

    def _finished(self, key: Hashable, future: asyncio.Future[T]) -> None:
        if self._running.get(key) is future:
            del self._running[key]
        if not future.cancelled():
            future.exception()  # retrieved: a read whose callers all left is not reported as never retrieved
