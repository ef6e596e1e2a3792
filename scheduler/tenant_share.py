"""Which tenant of a tier a worker serves next: token-weighted fair share (Virtual Token Counter scheduling).

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024): each tenant has a counter charged for
the service it got, in tokens (prompt tokens weighted ``input_weight``, generated tokens ``output_weight``); the
backlogged tenant with the smallest counter goes next. A tenant that comes back after having nothing queued is
lifted to the smallest counter among the tenants still queued, so it cannot spend credit saved while it was away,
and a tenant that floods cannot push another's requests behind its own: the difference in service between two
backlogged tenants stays bounded by about one request's tokens.

Pure bookkeeping, no I/O: the worker (workers/service/tenant_queues.py) says which tenants have requests queued, asks
``pick`` which to pull from, and charges what it served. Counters are per worker; several workers each
share their own pulls fairly, so the tier's service is shared fairly too.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable


# Counters kept for tenants not queued now, at most: a returning tenant is lifted to the others anyway, so an
# idle tenant's counter only matters while it is recent, and a worker sees tenants come and go for days.
MAX_IDLE_COUNTERS = 1024


class TenantShare:
    def __init__(self, input_weight: float = 1.0, output_weight: float = 2.0) -> None:
        """The weights follow the paper's default: a generated token costs about twice a prompt token."""
        self._input_weight = input_weight
        self._output_weight = output_weight
        self._counters: dict[str, float] = {}
        self._backlogged: set[str] = set()
        self._since: dict[str, int] = {}  # backlogged tenant -> when it became so (a number, ever growing)
        self._clock = itertools.count()

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def set_backlogged(self, tenants: Iterable[str]) -> None:
        """The tenants with requests queued now; one that was not before is lifted to the minimum of those that
        were (the paper's "lift": no saving up while away)."""
        tenants = set(tenants)
        returning = tenants - self._backlogged
        staying = tenants & self._backlogged
        if returning:
            floor = min((self.counter(t) for t in staying), default=None)
            if floor is None:  # everyone is new: measure from the smallest counter of all, so nobody jumps
                floor = min((self.counter(t) for t in tenants), default=0.0)
            for tenant in returning:
                self._counters[tenant] = max(self.counter(tenant), floor)
                self._since[tenant] = next(self._clock)
        for tenant in self._backlogged - tenants:
            self._since.pop(tenant, None)
        self._backlogged = tenants

    def order(self, tenants: Iterable[str]) -> list[str]:
        """``tenants`` (the backlogged ones to consider), least served first; between equals, the one backlogged
        longest (a returning tenant is lifted level with the least served, and many are when each tenant has a
        request at a time: by name, the same tenants would always come last)."""
        since, counters = self._since, self._counters
        return sorted(tenants, key=lambda t: (counters.get(t, 0.0), since.get(t, 0), t))

    def charge(self, tenant: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        """Record service given to ``tenant``."""
        self._counters[tenant] = self.counter(tenant) + (self._input_weight * prompt_tokens
                                                         + self._output_weight * generated_tokens)
        if len(self._counters) > len(self._backlogged) + MAX_IDLE_COUNTERS:
            self.forget(keep=())

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the counters of tenants not in ``keep`` and not queued (a worker sees tenants come and go)."""
        keep = set(keep) | self._backlogged
        self._counters = {t: c for t, c in self._counters.items() if t in keep}
