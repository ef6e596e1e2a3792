"""Which workers are alive right now, from their liveness pings, so a stream whose worker died ends in seconds.

Every worker publishes ``llm.alive.<worker_id>`` each ``ALIVE_INTERVAL_S`` from its event loop (a step running in
its thread does not hold them up). One subscription per gateway records when each worker was last heard; a relayed
request asks about the worker that took it. The heartbeat in the ``workers`` bucket is too slow for this: its TTL
is 10 s and a killed worker never deletes its entry. A ping's body is the seats the worker has free (requests it
would pull now): where a hedge may go (gateway/hedging.py).
"""

from __future__ import annotations

import time

from switchyard.shared import subjects

ALIVE_INTERVAL_S = subjects.ALIVE_INTERVAL_S
DEAD_AFTER_S = 3 * ALIVE_INTERVAL_S  # three pings missed: gone
# A ping's free seats are believed this long: one ping late is a loaded machine's jitter (an event loop behind by
# half a second now and then, at either end), which must not stop hedging when it is needed most; two missed and
# the worker is taken for stalled, with nowhere to hedge on it.
SEATS_BELIEVED_S = 2.5 * ALIVE_INTERVAL_S


class WorkerLiveness:
    """Last-heard times of every worker that pinged since ``start``."""

    def __init__(self) -> None:
        self._last_heard: dict[str, float] = {}
        self._free_seats: dict[str, int] = {}  # as of each worker's last ping
        self._listening_since = time.monotonic()
        self._nc = None
        self._num_reconnects = 0
        self._sub = None

    async def start(self, nc) -> None:
        async def heard(msg) -> None:
            worker_id = msg.subject.rsplit(".", 1)[-1]
            self._last_heard[worker_id] = time.monotonic()
            try:
                self._free_seats[worker_id] = int(msg.data) if msg.data else 0
            except ValueError:
                self._free_seats[worker_id] = 0

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

    def free_seats(self, worker_id: str) -> int:
        """The seats ``worker_id`` said it had free at its last ping, if that ping is recent (``SEATS_BELIEVED_S``),
        else 0."""
        last = self._last_heard.get(worker_id)
        if last is None or time.monotonic() - last > SEATS_BELIEVED_S:
            return 0
        return self._free_seats.get(worker_id, 0)
