"""Batch work yields to interactive work: the one place that decides how much.

Where a step's cost grows with its batch (CPUs), a step full of batch-job decodes delays the first token of an
interactive request that arrives meanwhile. So while interactive traffic is about (an interactive request is
running, or one arrived in the last ``busy_window_s``), batch (background) requests hold at most
``seats_when_busy`` seats and run at most that many per step, taking turns; when there is none, batch work uses
everything. The worker's capacity (workers/service/capacity.py) asks this policy before it pulls a batch request
and hands its per-step limit to the engine, whose scheduler applies it (``Scheduler.set_background_limit``).
Separately, a step that runs background sequences only is run a few layers at a time and dropped when an
interactive request is added (see ``Engine.step``): that rule needs no number from here.

Pure Python: time comes from ``clock`` (monotonic seconds), counts from the caller.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class BackgroundPolicy:
    """How many background (batch) sequences may hold seats and run per step right now."""

    def __init__(self, seats_when_busy: int | None, busy_window_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``seats_when_busy``: the limit while interactive traffic is about (None: never limited)."""
        if seats_when_busy is not None and seats_when_busy < 1:
            raise ValueError(f"seats_when_busy must be >= 1 or None, got {seats_when_busy}")
        self.seats_when_busy = seats_when_busy
        self.busy_window_s = busy_window_s
        self._clock = clock
        self._last_interactive_at = -float("inf")

    def note_arrival(self, is_background: bool) -> None:
        """A request arrived; an interactive one keeps the limit on for ``busy_window_s`` (the next one is likely
        to come soon, and should not find the engine in a step full of batch decodes)."""
        if not is_background:
            self._last_interactive_at = self._clock()

    def is_interactive_busy(self, interactive_running: bool) -> bool:
        return interactive_running or self._clock() - self._last_interactive_at < self.busy_window_s

    def step_limit(self, interactive_running: bool) -> int | None:
        """Background sequences that may run in the next step; None: no limit. ``interactive_running``: whether
        any interactive request runs (how many does not matter: one is enough to turn the limit on)."""
        if self.seats_when_busy is None or not self.is_interactive_busy(interactive_running):
            return None
        return self.seats_when_busy

    def may_take_background(self, num_background_held: int, interactive_running: bool) -> bool:
        """Whether the worker may pull one more background request, holding ``num_background_held`` already."""
        limit = self.step_limit(interactive_running)
        return limit is None or num_background_held < limit
