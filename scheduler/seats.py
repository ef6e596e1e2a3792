"""Who may take a running request's seat when every seat is taken: the one rule the engine's scheduler and the
worker's intake both follow.

    a request more important than the least important one running   ──▶ takes that one's seat
    a request of the same priority, whose tenant holds SEAT_GAP
    seats fewer than the tenant holding the most of that priority   ──▶ takes one of that tenant's seats
    anyone else                                                      ──▶ waits for a seat to free up

The scheduler applies it to choose whom to preempt (``Scheduler._victim_for``); the worker applies it to what it
may still pull from JetStream with no free seat (workers/service/capacity.py), so a pro request never waits in the
queue for a free one to finish and one tenant's flood cannot keep the others of its tier out of the batch. Tenants
are whatever names the caller counts by (the scheduler's ``Sequence.tenant``, the worker's subject tokens).

Pure Python, no I/O.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

# A tenant holding this many seats more than another gives one up to it: at one apart seats would move back and
# forth with every arrival (each move preempts a sequence, whose prompt is computed again); at two they settle
# evenly shared.
SEAT_GAP = 2


def outranks(priority: int, running_priority: int) -> bool:
    """Whether a request of ``priority`` takes the seat of a running one of ``running_priority`` (lower is more
    important): strictly more important only, so equals never preempt each other for priority's sake."""
    return priority < running_priority


class TenantSeats:
    """The seats one priority's tenants hold, and which of them may take a seat from the tenant holding most."""

    def __init__(self, tenants: Iterable[str]) -> None:
        """``tenants``: one entry per seat held (a tenant holding three seats appears three times)."""
        self.held = Counter(tenants)
        # Asked once per tenant or waiting request (may_take): computed each time, a thousand tenants' seats cost
        # a million steps per pull.
        self.most = max(self.held.values(), default=0)
        """The seats the tenant holding the most holds (0 when none are held)."""

    def holder(self) -> str | None:
        """The tenant that gives a seat up: the one holding the most (of equals, the greatest name, so the choice
        does not depend on arrival order); None when no seat is held."""
        if not self.held:
            return None
        return max(self.held.items(), key=lambda item: (item[1], item[0]))[0]

    def may_take(self, tenant: str) -> bool:
        """Whether ``tenant`` may take a seat from the holder (a tenant holding none counts as holding 0)."""
        return self.held.get(tenant, 0) + SEAT_GAP <= self.most

    def may_not_take(self) -> set[str] | None:
        """The tenants that may not take a seat, all of them holding some; None when no tenant may, not even one
        holding none (nobody holds ``SEAT_GAP`` seats)."""
        if not self.may_take_any():
            return None
        return {tenant for tenant in self.held if not self.may_take(tenant)}

    def num_to_give(self) -> int:
        """How many seats the tenants holding the most would give up, one after another, to tenants holding none:
        each holder down to ``SEAT_GAP - 1``, where no newcomer may take from it any more."""
        return sum(n - (SEAT_GAP - 1) for n in self.held.values() if n >= SEAT_GAP)

    def may_take_any(self) -> bool:
        """Whether some tenant, at least one holding no seat, may take one."""
        return SEAT_GAP <= self.most
