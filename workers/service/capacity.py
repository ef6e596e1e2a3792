"""What a worker may take on now: the one answer its intake (what to pull, from which tier, for which tenant) and
its step loop (how many batch sequences the next step runs) both ask for.

    the engine's capacity, as of its last step ─┐
    the requests held: pending, handed to the   ├──▶ allowance() ──▶ Allowance
      running step, running (by tier, tenant)   │                     num_free_seats     requests that fit now
    BackgroundPolicy: batch yields to           │                     pull               tier -> tenants not to pull for
      interactive work (scheduler/background)   │                     pause_over         tier -> whose requests a pull
    the seat rule (scheduler/seats.py)          │                                        would pause (a share gate)
    each tier's pausing quantum (pausing.py) ───┘                     background_limit   batch sequences per step

A request being prepared (tokenized, its grammar compiled) takes a seat already, and its tenant is not pulled for
until it is ready: one tenant's slow prompts hold one prepare thread and that tenant's own backlog, which stays
in JetStream, never the other tenants' turns. Unless every request it has in preparation is cheap by its size (no
grammar, no tools, a few short messages: prepare_cost.py), and fewer than ``CHEAP_PREPARING`` of them:
then it is pulled for meanwhile, since what it can put ahead of another tenant's prepare is a few milliseconds,
and one tenant's burst is no longer taken one request per pull and prepare (bench/burst.py).

With free seats every tier may be pulled. With every seat taken, only what the engine would give a running
request's seat to (the same seat rule its scheduler follows): a tier more important than the least important one
running, and in that tier the tenants two seats behind the one holding the most, so a pro request never waits in
JetStream for a free one to finish and one tenant's flood cannot keep the others out of the batch; at most
``max_num_seqs // 8`` of them wait in the engine at once. Batch requests are pulled only while the background
policy lets batch hold another seat.

Where the engine pauses (scheduler/pausing.py) and the least important running tier has a quantum, with every seat
taken one request at a time of a tenant holding none of that tier's seats is pulled, when requests past the quantum
run there: the intake pulls it only if the tier's fair share puts its tenant ahead of every tenant holding such a
request (``pause_over``; workers/service/tenant_queues.py), and the engine pauses one of them for it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from switchyard.scheduler.background import BackgroundPolicy
from switchyard.scheduler.seats import TenantSeats, outranks
from switchyard.shared import subjects
from switchyard.shared.config import WorkerConfig
from switchyard.shared.tiers import BATCH_TIER, get_tier, tiers_by_priority
from switchyard.workers.service.held import HeldRequests
from switchyard.workers.service.prepare_cost import is_cheap_to_prepare
from switchyard.workers.serving.interface import EngineCapacity

# A tenant whose requests in preparation are all cheap (prepare_cost.py) is pulled for until it has this many: what
# it then puts ahead of another tenant's prepare is a few milliseconds.
CHEAP_PREPARING = 32


@dataclass(frozen=True, slots=True)
class Allowance:
    """What may be taken on now; see the module docstring."""

    num_free_seats: int  # requests that may be pulled into free seats (<= 0: none)
    pull: dict[str, frozenset[str]]  # tier -> tenant tokens not to pull for (empty: any); an absent tier: none
    background_limit: int | None  # batch-tier sequences the next step may run (None: no limit)
    # tier -> the tenant tokens holding a request past the tier's pausing quantum: that tier's pull is for pausing
    # one of them, and only for a tenant the fair share puts ahead of them all (scheduler/pausing.ahead_in_share)
    pause_over: dict[str, frozenset[str]] = field(default_factory=dict)


def allowance(engine: EngineCapacity, held: HeldRequests, background: BackgroundPolicy,
              pause_after: dict[str, int] | None = None) -> Allowance:
    """What may be taken on, given the engine's capacity and what the worker holds on top of it; ``pause_after``:
    each tier's pausing quantum where the engine pauses (absent or 0: off)."""
    interactive_running = _interactive_running(held)
    # Requests handed to the running step are in the engine's count only once that step is done: count them here.
    num_free = engine.num_free_seats - len(held.pending) - held.num_admitting - len(held.preparing)
    pull: dict[str, frozenset[str]]
    pause_over: dict[str, frozenset[str]] = {}
    if num_free > 0:
        pull = {t.name: frozenset() for t in tiers_by_priority()}
    else:
        pull, pause_over = _seat_takers(engine, held, pause_after or {})
    preparing: dict[tuple[str, str], int] = {}  # (tier, tenant token) -> its requests in preparation, or a
    for tracked in held.preparing.values():     # number past the limit when one of them may be slow
        request = tracked.request
        key = (request.tier, subjects.tenant_token(request.tenant_id))
        preparing[key] = preparing.get(key, 0) + (1 if is_cheap_to_prepare(request) else CHEAP_PREPARING)
    for (tier, tenant), count in preparing.items():
        if tier in pull and count >= CHEAP_PREPARING:
            pull[tier] = pull[tier] | {tenant}
    if BATCH_TIER in pull:
        num_batch = (sum(t.request.tier == BATCH_TIER for t in held.active.values())
                     + sum(t.request.tier == BATCH_TIER for t, _ in held.pending))
        if not background.may_take_background(num_batch, interactive_running):
            del pull[BATCH_TIER]  # its seats while interactive traffic is about are taken
    return Allowance(num_free, pull, background.step_limit(interactive_running), pause_over)


def _interactive_running(held: HeldRequests) -> bool:
    """Whether any interactive request runs (all the batch policy asks): the first one found answers it."""
    return any(t.request.tier != BATCH_TIER for t in held.active.values())


def _seat_takers(engine: EngineCapacity, held: HeldRequests, pause_after: dict[str, int],
                 ) -> tuple[dict[str, frozenset[str]], dict[str, frozenset[str]]]:
    """With every seat taken: the tiers, and tenants of the least important running tier, whose requests the engine
    would give a running request's seat to; and the tier whose pull would pause a request (``pause_over``)."""
    # Requests pulled beyond the seats: new ones waiting in the engine or on their way in (not ones taking free
    # seats, nor ones preempted to make room: they were pulled long ago).
    beyond = (engine.num_running + engine.num_waiting_new + len(held.pending) + held.num_admitting
              + len(held.preparing) - engine.max_num_seqs)
    cap = max(1, engine.max_num_seqs // 8)
    if beyond >= cap or not held.active:
        return {}, {}
    least = max(get_tier(t.request.tier).priority for t in held.active.values())
    pull: dict[str, frozenset[str]] = {t.name: frozenset() for t in tiers_by_priority() if outranks(t.priority, least)}
    least_tier = next(t.name for t in tiers_by_priority() if t.priority == least)
    seats = TenantSeats(subjects.tenant_token(t.request.tenant_id) for t in held.active.values()
                        if t.request.tier == least_tier)
    excluded = seats.may_not_take()
    # Only as many of the tier's own as there are seats its holders would give up: one more waits in the engine
    # for a seat to free, ahead of whoever comes next, however much less that tenant was served (more would let one
    # tenant's second seat open the tier to every tenant holding none, and a light tenant wait behind all of them).
    if excluded is not None and beyond < seats.num_to_give():
        pull[least_tier] = frozenset(excluded)
    pause_over: dict[str, frozenset[str]] = {}
    after = pause_after.get(least_tier, 0)
    # Pausing: one at a time (nothing new waiting in the engine or on its way in), and while few are paused. Who
    # holds a pausable request is judged by its whole completion here (the engine counts since its last start, and
    # its pauses): where the engine then finds nobody to pause, the request waits for a free seat, first in line
    # (or takes one by the seat rule, where the seat takers above had reached their bound).
    arriving = engine.num_waiting_new + len(held.pending) + held.num_admitting + len(held.preparing)
    if after > 0 and least_tier not in pull and arriving == 0 and engine.num_waiting - engine.num_waiting_new < cap:
        over = frozenset(subjects.tenant_token(t.request.tenant_id) for t in held.active.values()
                         if t.request.tier == least_tier and t.completion_tokens >= after)
        if over:
            pull[least_tier] = frozenset(seats.held)  # a tenant holding a seat there pauses nobody
            pause_over[least_tier] = over
    return pull, pause_over


def _seats(engine: EngineCapacity) -> tuple[int, ...]:
    """What of the engine's capacity the allowance reads (not its KV usage, which moves with every token)."""
    return engine.max_num_seqs, engine.num_free_seats, engine.num_running, engine.num_waiting, engine.num_waiting_new


def background_policy(settings: WorkerConfig, device_type: str) -> BackgroundPolicy:
    """The batch policy a worker's settings ask for on its device: unset, 2 seats on a CPU (where a step's cost
    grows with its batch) and no limit on a GPU (where a decode step costs about the same for 1 or 32); 0: none."""
    seats = settings.batch_seqs_when_busy
    if seats is None:
        seats = 2 if device_type == "cpu" else 0
    return BackgroundPolicy(seats_when_busy=seats or None, busy_window_s=settings.interactive_busy_s)


class Capacity:
    """The worker's seats as its intake and step loop see them: the engine's capacity after its last step, the
    requests it holds on top, and the batch policy; ``changed`` is set whenever a step may have changed them."""

    def __init__(self, engine: EngineCapacity, held: HeldRequests, background: BackgroundPolicy,
                 pausing: bool = False) -> None:
        """``pausing``: the engine pauses long generations for waiting tenants (its capabilities)."""
        self.engine = engine
        self.held = held
        self.background = background
        self.changed = asyncio.Event()  # seats freed, or admissions that change who may take a seat
        self.pausing = pausing
        self.pause_after: dict[str, int] = {}  # tier -> its pausing quantum (TierPolicy.pause_after_tokens)
        self._pause_rules_new = False  # changed since the step loop last handed them to the engine

    def set_pause_after(self, pause_after: dict[str, int]) -> None:
        """The tiers' pausing quanta as the live policies say (the intake reads them); the engine gets them before
        its next step, and the pull rule uses them at once (where the engine pauses)."""
        pause_after = {tier: n for tier, n in pause_after.items() if n > 0} if self.pausing else {}
        if pause_after != self.pause_after:
            self.pause_after = pause_after
            self._pause_rules_new = True
            self.changed.set()

    def take_pause_rules(self) -> dict[str, int] | None:
        """The quanta for the engine, once after each change (None: unchanged, or an engine that does not pause)."""
        if not self._pause_rules_new:
            return None
        self._pause_rules_new = False
        return dict(self.pause_after)

    def update(self, engine: EngineCapacity | None, moved: bool = True) -> None:
        """After a step (or failing one): the engine's new capacity (None: unknown, keep the last). ``moved``: the
        step admitted, aborted, refused or finished a request, so who holds a seat changed. The intake is woken
        only then or when the engine's seats changed: a step that only generated tokens changes nothing it
        decides on, and waking it for each (hundreds a second with every seat taken) would cost the worker more CPU
        than its pulls (bench/tenants.py)."""
        if engine is not None:
            moved = moved or _seats(engine) != _seats(self.engine)
            self.engine = engine
        if moved or engine is None:
            self.changed.set()

    def allowance(self) -> Allowance:
        return allowance(self.engine, self.held, self.background, self.pause_after)

    def background_limit(self) -> int | None:
        """The allowance's ``background_limit`` alone (each step asks for it; the rest costs a count by tenant)."""
        return self.background.step_limit(_interactive_running(self.held))

    def summary(self) -> str:
        e, held = self.engine, self.held
        return (f"active={len(held.active)} preparing={len(held.preparing)} pending_adds={len(held.pending)} "
                f"admitting={held.num_admitting} "
                f"running={e.num_running} waiting={e.num_waiting} free_slots={e.num_free_seats} "
                f"kv_usage={e.kv_cache_usage:.2f}")
