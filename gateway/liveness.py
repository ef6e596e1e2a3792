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
        self._listening_since = time.monotonic()
        self._nc = None
        self._num_reconnects = 0
        self._sub = None

    async def start(self, nc) -> None:
        async def heard(msg) -> None:
            self._last_heard[msg.subject.rsplit(".", 1)[-1]] = time.monotonic()

        self._nc = nc
        self._num_reconnects = nc.stats["reconnects"]
        self._sub = await nc.subscribe(f"{subjects.ALIVE_PREFIX}.*", cb=heard)

    @property
    def num_reconnects(self) -> int:
        """How often this gateway's NATS connection was re-established: core messages sent meanwhile are lost."""
        return 0 if self._nc is None else self._nc.stats["reconnects"]

    def is_dead(self, worker_id: str) -> bool:
        """True once ``worker_id`` has not been heard for ``DEAD_AFTER_S`` while we were listening: pings missed
        while this gateway was itself disconnected (its NATS server lost, a reconnect to another) say nothing
        about the worker, so listening starts over at each reconnect, and at our start for one never heard."""
        if self._nc is not None:
            if not self._nc.is_connected:
                return False
            if self._nc.stats["reconnects"] != self._num_reconnects:
                self._num_reconnects = self._nc.stats["reconnects"]
                self._listening_since = time.monotonic()
        last = max(self._last_heard.get(worker_id, 0.0), self._listening_since)
        return time.monotonic() - last > DEAD_AFTER_S
