"""Which tenant of a tier a worker serves next: token-weighted fair share (Virtual Token Counter scheduling).

After Sheng et al., "Fairness in Serving Large Language Models" (OSDI 2024): each tenant has a counter charged for
the service it got, in tokens (prompt tokens weighted ``input_weight``, generated tokens ``output_weight``); the
backlogged tenant with the smallest counter goes next. A tenant that comes back after having nothing queued is
lifted to the smallest counter among the tenants still queued, so it cannot spend credit saved while it was away,
and a tenant that floods cannot push another's requests behind its own: the difference in service between two
backlogged tenants stays bounded by about one request's tokens.

Counters alone order tenants badly when many are level: a thousand tenants, each waiting for one long request, sit
at the same counter, and a light tenant one short request above them waits until every one of them has had its
long request (a whole round of the seats). So the order adds each tenant's next request's expected cost to its
counter (start-time fair queueing's finish tag: whose next request would be done first in virtual time), predicted
by the tenant's last finished request (prompt and output lengths are unknown before a request is pulled; a tenant's
requests tend to be alike, and a wrong guess costs one request's place). A tenant never seen finished counts 0.

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
        self._before_lift: dict[str, float] = {}  # backlogged tenant -> its own counter when it came back
        self._last_cost: dict[str, float] = {}  # tenant -> its last finished request's cost (its next one's guess)
        self._clock = itertools.count()

    def tenant_state(self) -> dict[str, int]:
        """Tenants with a counter, with a last cost, backlogged (``_since`` and ``_before_lift`` hold only these)."""
        return {"fair_share_counters": len(self._counters), "fair_share_costs": len(self._last_cost),
                "fair_share_backlogged": len(self._backlogged)}

    def counter(self, tenant: str) -> float:
        return self._counters.get(tenant, 0.0)

    def finish_tag(self, tenant: str) -> float:
        """When ``tenant``'s next request would be done in virtual time: its counter plus that request's expected
        cost (the key ``order`` sorts by first)."""
        return self._counters.get(tenant, 0.0) + self._last_cost.get(tenant, 0.0)

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
                self._before_lift[tenant] = self.counter(tenant)
                self._counters[tenant] = max(self.counter(tenant), floor)
                self._since[tenant] = next(self._clock)
        for tenant in self._backlogged - tenants:
            self.drained(tenant)
        self._backlogged = tenants

    def drained(self, tenant: str) -> None:
        """``tenant`` has nothing queued any more: it is no longer backlogged (as ``set_backlogged`` without it
        would say, but at once: the worker learns this from an empty pull, and may pull nothing for a long while
        after)."""
        self._backlogged.discard(tenant)
        self._since.pop(tenant, None)
        self._before_lift.pop(tenant, None)

    def order(self, tenants: Iterable[str]) -> list[str]:
        """``tenants`` (the backlogged ones to consider), the one whose next request would finish first in virtual
        time first: its counter plus that request's expected cost (its last one's). Many are equal when each tenant
        has a request at a time: every one that comes back is lifted level with the least served. Between equals,
        the one that had been served least before it was lifted (a light tenant, next to ones that come back from
        long requests, is not queued behind them all), then the one backlogged longest (by name, the same tenants
        would always come last)."""
        since, counters, before, cost = self._since, self._counters, self._before_lift, self._last_cost
        return sorted(tenants, key=lambda t: (counters.get(t, 0.0) + cost.get(t, 0.0), before.get(t, 0.0),
                                              since.get(t, 0), t))

    def finished(self, tenant: str, prompt_tokens: int, generated_tokens: int) -> None:
        """A request of ``tenant`` ended with these tokens: the guess of its next one's cost (service is charged
        as it is given, by ``charge``)."""
        self._last_cost[tenant] = self._input_weight * prompt_tokens + self._output_weight * generated_tokens

    def charge(self, tenant: str, prompt_tokens: int = 0, generated_tokens: int = 0) -> None:
        """Record service given to ``tenant``."""
        self._counters[tenant] = self.counter(tenant) + (self._input_weight * prompt_tokens
                                                         + self._output_weight * generated_tokens)
        if tenant in self._before_lift:  # served since it came back: its place among equals is its counter's
            self._before_lift[tenant] = self._counters[tenant]
        if len(self._counters) > len(self._backlogged) + MAX_IDLE_COUNTERS:
            self.forget(keep=())

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the counters of tenants not in ``keep`` and not queued (a worker sees tenants come and go)."""
        keep = set(keep) | self._backlogged
        self._counters = {t: c for t, c in self._counters.items() if t in keep}
        self._last_cost = {t: c for t, c in self._last_cost.items() if t in keep}
