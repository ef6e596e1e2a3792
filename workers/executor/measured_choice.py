"""Which of a few ways of running a step is cheapest, chosen by measuring steps while serving: per class of step,
the candidate with the lowest recent cost, each of the others tried again now and then.

    each step ──▶ its class (the caller's: a step's tokens, its batch's sequences, by powers of two)
              ──▶ the candidate with the lowest recent cost in that class (the first candidate at first)
              ──▶ now and then a class's next EXPLORE_STEPS steps run another candidate instead, so an estimate
                  made under other conditions is made again (the cost: a few slower steps): EXPLORE_EVERY_S (or
                  the caller's interval) after the class is first seen, then each time twice as late, up to
                  MAX_EXPLORE_EVERY_S; and at once, from the first interval again, when the candidate in use has
                  become DRIFT times slower or faster than when it was chosen (what else runs on the cores changed)

An estimate is the mean of a class's last WINDOW costs of a candidate: the one in use kept current by every step,
another's made afresh by each try of WINDOW + 1 steps. A step the caller says is not representative (the first
after a change, which pays for the change) is not counted, on either side. Equal windows on both sides, so that a try
is judged as the candidate in use is (beside busy processes a step's time varies several-fold). Used for the CPU
step's thread count (thread_tuner.py) and for whether a step speculates (workers/engine/speculation_gate.py).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

EXPLORE_EVERY_S = 5.0
MAX_EXPLORE_EVERY_S = 80.0
WINDOW = 8  # steps an estimate is the mean of; a try runs this many after its first
EXPLORE_STEPS = WINDOW + 1
# Another candidate replaces the one in use only when its estimate is this much lower (steps are noisy; a change
# back and forth on noise costs the change each time).
SWITCH_MARGIN = 0.9
DRIFT = 1.5

C = TypeVar("C", bound=Hashable)


class MeasuredChoice(Generic[C]):
    """Per class of step, the cheapest of ``candidates`` as measured (``choose``, then ``observed``)."""

    def __init__(self, candidates: Sequence[C], clock: Callable[[], float] = time.monotonic,
                 explore_every_s: float | None = None) -> None:
        """``candidates``: the first is used until another has been measured cheaper; ``explore_every_s``: when a
        class first tries another, and how far apart tries begin (None: EXPLORE_EVERY_S)."""
        self.candidates = list(candidates)
        self._clock = clock
        self._first_s = EXPLORE_EVERY_S if explore_every_s is None else explore_every_s
        self._best: dict[int, C] = {}  # class -> the candidate its steps use
        self._costs: dict[tuple[int, C], deque[float]] = {}  # (class, candidate) -> its last costs
        self._explore_at: dict[int, float] = {}  # class -> when it next tries another candidate
        self._exploring: dict[int, tuple[C, int]] = {}  # class -> (candidate tried, steps left)
        self._turns: dict[int, int] = {}  # class -> explorations so far (whose turn among the others)
        self._explore_every: dict[int, float] = {}  # class -> seconds from one try to the next
        self._chosen_at: dict[int, float] = {}  # class -> its candidate's estimate when last chosen or checked

    def choose(self, klass: int) -> C:
        """The candidate for the next step of ``klass``; report its cost with ``observed``."""
        trying = self._exploring.get(klass)
        if trying is None and len(self.candidates) > 1:
            now = self._clock()
            due = self._explore_at.setdefault(klass, now + self._first_s)
            if now >= due:
                trying = self._exploring[klass] = (self._next_to_try(klass), EXPLORE_STEPS)
                self._costs.pop((klass, trying[0]), None)  # made afresh: what it was then says little now
        return trying[0] if trying is not None else self.best(klass)

    def observed(self, klass: int, candidate: C, cost: float, counted: bool = True) -> None:
        """A step of ``klass`` run with ``candidate`` cost ``cost``; ``counted`` False: it says nothing of the
        candidate's cost (it paid for a change), but it still takes its place in a try."""
        key = (klass, candidate)
        trying = self._exploring.get(klass)
        if trying is not None and trying[0] == candidate:
            if counted:
                self._costs.setdefault(key, deque(maxlen=WINDOW)).append(cost)
            if trying[1] > 1:
                self._exploring[klass] = (candidate, trying[1] - 1)
                return
            del self._exploring[klass]
            self._best[klass] = self._pick(klass)
            every = self._explore_every[klass] = min(MAX_EXPLORE_EVERY_S,
                                                     2 * self._explore_every.get(klass, self._first_s / 2))
            self._explore_at[klass] = self._clock() + every
            self._chosen_at[klass] = self._estimate(klass, self._best[klass]) or 0.0
            return
        if counted:
            self._costs.setdefault(key, deque(maxlen=WINDOW)).append(cost)
        estimate = self._estimate(klass, candidate)
        chosen_at = self._chosen_at.get(klass)
        if chosen_at and estimate and candidate == self.best(klass) and not (chosen_at / DRIFT < estimate
                                                                             < chosen_at * DRIFT):
            self._explore_at[klass] = self._clock()  # conditions changed: the next step of the class tries
            self._explore_every[klass] = self._first_s / 2
            self._chosen_at[klass] = estimate
        best = self._pick(klass)
        if best != self.best(klass):
            self._chosen_at[klass] = self._estimate(klass, best) or 0.0
        self._best[klass] = best

    def best(self, klass: int) -> C:
        """The candidate steps of ``klass`` use now (outside exploration)."""
        return self._best.get(klass, self.candidates[0])

    def _estimate(self, klass: int, candidate: C) -> float | None:
        """Mean cost of the class's last steps with ``candidate``; None before any was counted."""
        costs = self._costs.get((klass, candidate))
        return statistics.fmean(costs) if costs else None

    def _pick(self, klass: int) -> C:
        current = self.best(klass)
        held = self._estimate(klass, current)
        measured = [(cost, i) for i, c in enumerate(self.candidates)
                    if (cost := self._estimate(klass, c)) is not None]
        if not measured:
            return current
        cheapest_cost, cheapest = min(measured)
        if held is None or cheapest_cost < SWITCH_MARGIN * held:
            return self.candidates[cheapest]
        return current

    def _next_to_try(self, klass: int) -> C:
        """A candidate other than the one in use: one never measured for this class first, else each in turn."""
        current = self.best(klass)
        others = [c for c in self.candidates if c != current]
        unmeasured = [c for c in others if (klass, c) not in self._costs]
        if unmeasured:
            return unmeasured[0]
        turn = self._turns[klass] = self._turns.get(klass, 0) + 1
        return others[turn % len(others)]
