"""How many threads a CPU step runs on, chosen by measuring steps while serving.

A step's OpenMP regions end at a barrier: every thread waits for the slowest. On cores nothing else wants, more
threads finish a step sooner. When other processes share the cores (the gateway, NATS and Postgres of a one-machine
deployment, a neighbour's job), the kernel sets one of the step's threads aside now and then, and every region
waits for it: two threads on two shared cores can be several times slower than one (bench/contention.py).
Which is faster depends on what else runs, which changes, so it is measured, not configured
(measured_choice.py): each step's size class is its tokens by powers of two (a 1-token decode and a 512-token
prefill differ); the candidates are the cores given, half of them and one; the first step after a change of count
is not counted, on either side: it pays for waking or parking threads.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from switchyard.workers.executor.measured_choice import MeasuredChoice


class ThreadTuner:
    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``max_threads``: the most a step may use (the threads kernels' workspaces were sized for);
        ``set_threads``: applies a count (``torch.set_num_threads``)."""
        self.candidates = sorted({max_threads, max(1, max_threads // 2), 1}, reverse=True)
        self._choice: MeasuredChoice[int] = MeasuredChoice(self.candidates, clock)
        self._set_threads = set_threads
        self._applied = max_threads
        self._changed = False  # the count changed for the step being run: its time is not counted

    def choose(self, num_tokens: int) -> int:
        """The thread count for a step of ``num_tokens`` tokens, applied; report its time with ``observed``."""
        threads = self._choice.choose(num_tokens.bit_length())
        self._changed = threads != self._applied
        if self._changed:
            self._set_threads(threads)
            self._applied = threads
        return threads

    def observed(self, num_tokens: int, threads: int, seconds: float) -> None:
        """A step of ``num_tokens`` tokens took ``seconds`` on ``threads``."""
        counted, self._changed = not self._changed, False
        self._choice.observed(num_tokens.bit_length(), threads, seconds, counted)

    def best(self, num_tokens: int) -> int:
        """The count steps of ``num_tokens`` tokens run on now (outside exploration)."""
        return self._choice.best(num_tokens.bit_length())
