"""How many threads a CPU step runs on, chosen by measuring steps while serving.

A step's OpenMP regions end at a barrier: every thread waits for the slowest. On cores nothing else wants, more
threads finish a step sooner. When other processes share the cores (the gateway, NATS and Postgres of a one-machine
deployment, a neighbour's job), the kernel sets one of the step's threads aside now and then, and every region
waits for it: two threads on two shared cores can be several times slower than one (bench/contention.py).
Which is faster depends on what else runs, which changes, so it is measured, not configured:

    each step ──▶ its size class (its tokens, by powers of two: a 1-token decode and a 512-token prefill differ)
              ──▶ the thread count with the lowest recent seconds per step in that class (all of them at first)
              ──▶ now and then a class's next EXPLORE_STEPS steps run on another count instead, so an estimate
                  made under other conditions is made again (the cost: a few slower steps): EXPLORE_EVERY_S after
                  the class is first seen, then each time twice as late, up to MAX_EXPLORE_EVERY_S; and at once,
                  from EXPLORE_EVERY_S again, when the count in use has become DRIFT times slower or faster than
                  when it was chosen (what else runs on the cores changed)

The candidates are the cores given, half of them and one. An estimate is a moving average of a class's step times
on a count, the one in use kept current by every step, another's made afresh by each try.
"""

from __future__ import annotations

import time
from collections.abc import Callable

EXPLORE_EVERY_S = 5.0
MAX_EXPLORE_EVERY_S = 80.0
EXPLORE_STEPS = 4
SMOOTHING = 0.3  # weight of the newest step time in its estimate
# Another count replaces the one in use only when its estimate is this much lower (steps are noisy; a change
# back and forth on noise costs a region's pool resize each time).
SWITCH_MARGIN = 0.9
DRIFT = 1.5


class ThreadTuner:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``max_threads``: the most a step may use (the threads kernels' workspaces were sized for);
        ``set_threads``: applies a count (``torch.set_num_threads``)."""
        self.candidates = sorted({max_threads, max(1, max_threads // 2), 1}, reverse=True)
        self._set_threads = set_threads
        self._clock = clock
        self._applied = max_threads
        self._best: dict[int, int] = {}  # size class -> the count its steps run on
        self._estimates: dict[tuple[int, int], float] = {}  # (size class, threads) -> seconds per step
        self._explore_at: dict[int, float] = {}  # size class -> when it next tries another count
        self._exploring: dict[int, tuple[int, int]] = {}  # size class -> (count tried, steps left)
        self._turns: dict[int, int] = {}  # size class -> explorations so far (whose turn among the others)
        self._explore_every: dict[int, float] = {}  # size class -> seconds from one try to the next
        self._chosen_at: dict[int, float] = {}  # size class -> its count's estimate when last chosen or checked

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of ``num_tokens`` tokens, applied; report its time with ``observed``."""
        size = num_tokens.bit_length()
        trying = self._exploring.get(size)
        if trying is None and len(self.candidates) > 1:
            now = self._clock()
            due = self._explore_at.setdefault(size, now + EXPLORE_EVERY_S)
            if now >= due:
                trying = self._exploring[size] = (self._next_to_try(size), EXPLORE_STEPS)
                self._estimates.pop((size, trying[0]), None)  # made afresh: what it was then says little now
        threads = trying[0] if trying is not None else self._best.get(size, self.candidates[0])
        if threads != self._applied:
            self._set_threads(threads)
            self._applied = threads
        return threads

    def observed(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens took ``seconds`` on ``threads``."""
        size = num_tokens.bit_length()
        key = (size, threads)
        last = self._estimates.get(key)
        self._estimates[key] = seconds if last is None else SMOOTHING * seconds + (1 - SMOOTHING) * last
        trying = self._exploring.get(size)
        if trying is not None and trying[0] == threads:
            if trying[1] > 1:
                self._exploring[size] = (threads, trying[1] - 1)
                return
            del self._exploring[size]
            self._best[size] = self._pick(size)
            every = self._explore_every[size] = min(MAX_EXPLORE_EVERY_S,
                                                    2 * self._explore_every.get(size, EXPLORE_EVERY_S / 2))
            self._explore_at[size] = self._clock() + every
            self._chosen_at[size] = self._estimates.get((size, self._best[size]), 0.0)
            return
        chosen_at = self._chosen_at.get(size)
        if chosen_at and threads == self._best.get(size) and not (chosen_at / DRIFT < self._estimates[key]
                                                                  < chosen_at * DRIFT):
            self._explore_at[size] = self._clock()  # conditions changed: the next step of the class tries
            self._explore_every[size] = EXPLORE_EVERY_S / 2
            self._chosen_at[size] = self._estimates[key]
        best = self._pick(size)
        if best != self._best.get(size, self.candidates[0]):
            self._chosen_at[size] = self._estimates.get((size, best), 0.0)
        self._best[size] = best

    def best(self, num_tokens: int) -> int:
        """The count steps of ``num_tokens`` tokens run on now (outside exploration)."""
        return self._best.get(num_tokens.bit_length(), self.candidates[0])

    def _pick(self, size: int) -> int:
        current = self._best.get(size, self.candidates[0])
        held = self._estimates.get((size, current))
        measured = [(seconds, threads) for threads in self.candidates
                    if (seconds := self._estimates.get((size, threads))) is not None]
        fastest_s, fastest = min(measured)
        if held is None or fastest_s < SWITCH_MARGIN * held:
            return fastest
        return current

    def _next_to_try(self, size: int) -> int:
        """A count other than the one in use: one never measured for this class first, else each in turn."""
        current = self._best.get(size, self.candidates[0])
        others = [t for t in self.candidates if t != current]
        unmeasured = [t for t in others if (size, t) not in self._estimates]
        if unmeasured:
            return unmeasured[0]
        turn = self._turns[size] = self._turns.get(size, 0) + 1
        return others[turn % len(others)]
