"""The queue consumers a worker made, by (tier, tenant): their names, so a pull does not ask JetStream to make one
again each time, forgotten once the server has forgotten them.

JetStream deletes a tenant's consumer nobody pulled from for ``REQUEST_CONSUMER_IDLE_S`` (shared/jetstream.py), so
a name unused that long names nothing any more: it is dropped here too, and what a worker holds per tenant stays
bounded by the tenants active in that window, however many came and went.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from switchyard.shared.jetstream import REQUEST_CONSUMER_IDLE_S

Key = tuple[str, str]  # (tier, tenant token), or ("offer", tier) for this worker's offers
Name = tuple[str, str]  # (stream, consumer)


class ConsumerNames:
    def __init__(self, idle_s: float = REQUEST_CONSUMER_IDLE_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._idle_s = idle_s
        self._clock = clock
        self._names: OrderedDict[Key, tuple[Name, float]] = OrderedDict()  # least recently used first

    def get(self, key: Key) -> Name | None:
        """The consumer made for ``key``, if it may still exist (its use is noted)."""
        self._forget_idle()
        known = self._names.get(key)
        if known is None:
            return None
        self._names[key] = (known[0], self._clock())
        self._names.move_to_end(key)
        return known[0]

    def put(self, key: Key, name: Name) -> None:
        self._names[key] = (name, self._clock())
        self._names.move_to_end(key)

    def pop(self, key: Key) -> None:
        """``key``'s consumer is gone (deleted while idle, a fresh server): made again at its next pull."""
        self._names.pop(key, None)

    def __len__(self) -> int:
        return len(self._names)

    def _forget_idle(self) -> None:
        oldest = self._clock() - self._idle_s
        while self._names:
            key, (_, used_at) = next(iter(self._names.items()))
            if used_at > oldest:
                return
            del self._names[key]
