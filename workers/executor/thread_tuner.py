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

The candidates are the cores given, half of them and one. An estimate is the mean of a class's last WINDOW step
times on a count: the one in use kept current by every step, another's made afresh by each try of WINDOW + 1 steps. The
first step after a change of count is not counted, on either side: it pays for waking or parking threads. Equal
windows on both sides, so that a try is judged as the count in use is (beside busy processes a step's time varies
several-fold).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

EXPLORE_EVERY_S = 5.0
MAX_EXPLORE_EVERY_S = 80.0
WINDOW = 8  # steps an estimate is the mean of; a try runs this many after its first
EXPLORE_STEPS = WINDOW + 1
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
        self._changed = False  # the count changed for the step being run: its time is not counted
        self._best: dict[int, int] = {}  # size class -> the count its steps run on
        self._times: dict[tuple[int, int], deque[float]] = {}  # (size class, threads) -> its last step times
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
                self._times.pop((size, trying[0]), None)  # made afresh: what it was then says little now
        threads = trying[0] if trying is not None else self._best.get(size, self.candidates[0])
        self._changed = threads != self._applied
        if self._changed:
            self._set_threads(threads)
            self._applied = threads
        return threads

    def observed(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens took ``seconds`` on ``threads``."""
        size = num_tokens.bit_length()
        key = (size, threads)
        counted, self._changed = not self._changed, False
        trying = self._exploring.get(size)
        if trying is not None and trying[0] == threads:
            if counted:
                self._times.setdefault(key, deque(maxlen=WINDOW)).append(seconds)
            if trying[1] > 1:
                self._exploring[size] = (threads, trying[1] - 1)
                return
            del self._exploring[size]
            self._best[size] = self._pick(size)
            every = self._explore_every[size] = min(MAX_EXPLORE_EVERY_S,
                                                    2 * self._explore_every.get(size, EXPLORE_EVERY_S / 2))
            self._explore_at[size] = self._clock() + every
            self._chosen_at[size] = self._estimate(size, self._best[size]) or 0.0
            return
        if counted:
            self._times.setdefault(key, deque(maxlen=WINDOW)).append(seconds)
        estimate = self._estimate(size, threads)
        chosen_at = self._chosen_at.get(size)
        if chosen_at and estimate and threads == self._best.get(size) and not (chosen_at / DRIFT < estimate
                                                                               < chosen_at * DRIFT):
            self._explore_at[size] = self._clock()  # conditions changed: the next step of the class tries
            self._explore_every[size] = EXPLORE_EVERY_S / 2
            self._chosen_at[size] = estimate
        best = self._pick(size)
        if best != self._best.get(size, self.candidates[0]):
            self._chosen_at[size] = self._estimate(size, best) or 0.0
        self._best[size] = best

    def best(self, num_tokens: int) -> int:
        """The count steps of ``num_tokens`` tokens run on now (outside exploration)."""
        return self._best.get(num_tokens.bit_length(), self.candidates[0])

    def _estimate(self, size: int, threads: int) -> float | None:
        """Mean seconds of the class's last steps on ``threads``; None before any was counted."""
        times = self._times.get((size, threads))
        return statistics.fmean(times) if times else None

    def _pick(self, size: int) -> int:
        current = self._best.get(size, self.candidates[0])
        held = self._estimate(size, current)
        measured = [(seconds, threads) for threads in self.candidates
                    if (seconds := self._estimate(size, threads)) is not None]
        if not measured:
            return current
        fastest_s, fastest = min(measured)
        if held is None or fastest_s < SWITCH_MARGIN * held:
            return fastest
        return current

    def _next_to_try(self, size: int) -> int:
        """A count other than the one in use: one never measured for this class first, else each in turn."""
        current = self._best.get(size, self.candidates[0])
        others = [t for t in self.candidates if t != current]
        unmeasured = [t for t in others if (size, t) not in self._times]
        if unmeasured:
            return unmeasured[0]
        turn = self._turns[size] = self._turns.get(size, 0) + 1
        return others[turn % len(others)]
