"""Who may pause a long generation's seat for a waiting tenant: the rule the engine's scheduler, the simulated engine
and the worker's intake all follow (a sibling of seats.py, which says who may take a seat outright).

    every seat of a priority taken, and a new request of that priority waits
      ├─ a running request of it has generated >= ``after_tokens`` since it last started    (the tier's quantum)
      ├─ ... and has been paused fewer than ``max_pauses`` times                             (nothing starves)
      └─ ... and its tenant holds more of those seats than the waiting request's tenant
         ──▶ that request is paused: its KV, its place and its tokens kept; the new one takes its seat;
             the paused one resumes into the next seat that frees, ahead of the requests that came after it

A pause is not a preemption: nothing is recomputed and nothing is lost, the paused client only sees a longer gap
between two tokens. Only a new request pauses another (a paused or preempted one waits for a free seat), so a pause
never sets off another.

Which waiting request gets to pause is a matter of share, and the worker's intake decides it when, with every seat
taken, it pulls one more from JetStream (workers/service/capacity.py): only a tenant whose next request would be
done, in the tier's fair-share virtual time (scheduler/tenant_share.py), before any pausable running request's
tenant has already been served (``ahead_in_share``). A tenant far below its share (a light one among a thousand
busy ones) gets a seat at once; the busy ones, level with each other, wait for seats to free as before, so pauses
stay rare and the paused requests few.

Pure Python, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

from switchyard.scheduler.seats import TenantSeats

# At most this many pauses of one request: with the quantum counted from its last start, a request keeps at least
# (MAX_PAUSES + 1) quanta of running in between, and always finishes.
MAX_PAUSES = 3


@dataclass(frozen=True, slots=True)
class PauseRule:
    """A priority's pausing: ``after_tokens`` generated since a request last started make it pausable (0: never);
    ``max_pauses`` pauses at most per request."""

    after_tokens: int = 0
    max_pauses: int = MAX_PAUSES

    def __post_init__(self) -> None:
        if self.after_tokens < 0:
            raise ValueError(f"after_tokens must be 0 (off) or more, got {self.after_tokens}")
        if self.max_pauses < 0:
            raise ValueError(f"max_pauses must be 0 or more, got {self.max_pauses}")

    @property
    def is_on(self) -> bool:
        return self.after_tokens > 0 and self.max_pauses > 0

    def is_pausable(self, num_tokens_since_start: int, num_pauses: int) -> bool:
        """Whether a running request that generated ``num_tokens_since_start`` since it last started, and was
        paused ``num_pauses`` times, may be paused."""
        return self.is_on and num_tokens_since_start >= self.after_tokens and num_pauses < self.max_pauses


OFF = PauseRule()

T = TypeVar("T")


def pause_victim(running: Iterable[T], seats: TenantSeats, tenant: str, rule: PauseRule,
                 tenant_of: Callable[[T], str], progress_of: Callable[[T], tuple[int, int]]) -> T | None:
    """Which of ``running`` (one priority's running requests, whose seats ``seats`` counts) a new request of
    ``tenant`` pauses, or None. ``progress_of(r)``: (tokens generated since ``r`` last started, times paused).

    Of the pausable ones whose tenant holds more seats than ``tenant``: the tenant holding the most first, then the
    request that has run longest since it started (it has had the most of its turn), then the last in
    ``running``'s order (callers pass it oldest first, so the newest of equals yields, as in preemption)."""
    if not rule.is_on:
        return None
    mine = seats.held.get(tenant, 0)
    best: T | None = None
    best_key: tuple[int, int] | None = None
    for r in running:
        held = seats.held.get(tenant_of(r), 0)
        if held <= mine:
            continue
        since, pauses = progress_of(r)
        if not rule.is_pausable(since, pauses):
            continue
        key = (held, since)
        if best_key is None or key >= best_key:
            best, best_key = r, key
    return best


def ahead_in_share(finish_tag: float, pausable_counters: Iterable[float]) -> bool:
    """Whether a waiting tenant whose next request would be done at ``finish_tag`` in the tier's fair-share
    virtual time (its counter plus that request's expected cost) may pause a seat: it is ahead of every tenant
    holding a pausable request (their counters: the service they have had), so whichever of them yields has been
    served more than the waiting tenant will have been once served. False when nobody holds a pausable request."""
    counters = list(pausable_counters)
    return bool(counters) and finish_tag < min(counters)
