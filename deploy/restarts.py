"""``switchyard up`` keeps its services running: one that exits is started again, with a backoff.

A crash loop backs off (1 s, doubling up to 30 s) instead of spinning; a service that then runs for a minute
counts as healthy again and its next crash restarts it after 1 s. Nothing else is touched: a crashed worker does
not take the gateway, and the streams it serves, down with it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from switchyard.deploy.services import ServiceProcess

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
HEALTHY_AFTER_S = 60.0


class Restarter:
    """Call ``poll()`` every few hundred milliseconds; it restarts whatever exited once its backoff is over."""

    def __init__(self, services: list[ServiceProcess], say: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._services = services
        self._say = say
        self._clock = clock
        now = clock()
        self._started_at = {svc.name: now for svc in services}
        self._backoff = {svc.name: FIRST_BACKOFF_S for svc in services}
        self._due: dict[str, float] = {}  # exited services: when they start again
        self.num_restarts = 0

    def poll(self) -> None:
        now = self._clock()
        for svc in self._services:
            if svc.is_running():
                continue
            if svc.name not in self._due:
                if now - self._started_at[svc.name] >= HEALTHY_AFTER_S:
                    self._backoff[svc.name] = FIRST_BACKOFF_S
                delay = self._backoff[svc.name]
                self._due[svc.name] = now + delay
                self._say(f"{svc.name} exited (status {svc.returncode}); starting it again in {delay:.0f} s")
                continue
            if now >= self._due[svc.name]:
                del self._due[svc.name]
                svc.start()
                self._started_at[svc.name] = now
                self._backoff[svc.name] = min(self._backoff[svc.name] * 2, MAX_BACKOFF_S)
                self.num_restarts += 1
                self._say(f"{svc.name} started again (pid {svc.pid})")
