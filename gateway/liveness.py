"""Which workers are alive right now, from their liveness pings, so a stream whose worker died ends in seconds.

Every worker publishes ``llm.alive.<worker_id>`` each ``ALIVE_INTERVAL_S`` from its event loop (a step running in
its thread does not hold them up). One subscription per gateway records when each worker was last heard; a relayed
request asks about the worker that took it. The heartbeat in the ``workers`` bucket is too slow for this: its TTL
is 10 s and a killed worker never deletes its entry.
"""

from __future__ import annotations

import time

from switchyard.shared import subjects

ALIVE_INTERVAL_S = subjects.ALIVE_INTERVAL_S
DEAD_AFTER_S = 3 * ALIVE_INTERVAL_S  # three pings missed: gone


class WorkerLiveness:
    """Last-heard times of every worker that pinged since ``start``."""

    def __init__(self) -> None:
        self._last_heard: dict[str, float] = {}
        self._started_at = time.monotonic()
        self._sub = None

    async def start(self, nc) -> None:
        async def heard(msg) -> None:
            self._last_heard[msg.subject.rsplit(".", 1)[-1]] = time.monotonic()

        self._sub = await nc.subscribe(f"{subjects.ALIVE_PREFIX}.*", cb=heard)

    def is_dead(self, worker_id: str) -> bool:
        """True once ``worker_id`` has not been heard for ``DEAD_AFTER_S`` (counted from our start for one never
        heard: it may have pinged just before we listened)."""
        last = self._last_heard.get(worker_id, self._started_at)
        return time.monotonic() - last > DEAD_AFTER_S
