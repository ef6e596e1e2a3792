"""The gateway's event-loop lag: how late a timer fires on its loop, observed every ``INTERVAL_S``.

Every request a gateway serves shares one asyncio loop: authentication, admission, the relay of every stream. When
that loop is late, each await of each request is late by as much, so a first token that reached the gateway in
time reaches its client seconds later and no queue or database metric shows why. A loop that is late because the
process is busy (its own work) and one that is late because the machine is (other processes on its cores) look the
same here; the process's CPU time tells them apart.
"""

from __future__ import annotations

import asyncio
import contextlib

from prometheus_client import Histogram

INTERVAL_S = 0.1


class LoopLagProbe:
    """Observes into ``histogram`` how late a ``interval_s`` sleep wakes, until stopped."""

    def __init__(self, histogram: Histogram, interval_s: float = INTERVAL_S) -> None:
        self._histogram, self._interval_s = histogram, interval_s
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asleep_at = loop.time()
            await asyncio.sleep(self._interval_s)
            self._histogram.observe(max(0.0, loop.time() - asleep_at - self._interval_s))
