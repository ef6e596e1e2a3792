"""The CPU step's thread count chosen by measurement (workers/executor/thread_tuner.py): all threads until another
count has been tried, the faster count kept per step size, tried again later, never flapping on noise."""

from __future__ import annotations

from switchyard.workers.executor.measured_choice import EXPLORE_EVERY_S, MAX_EXPLORE_EVERY_S
from switchyard.workers.executor.thread_tuner import ThreadTuner


class Machine:
    """A fake clock and the seconds a step takes per thread count (as other processes make them)."""

    def __init__(self, seconds: dict[int, float]) -> None:
        self.now = 0.0
        self.seconds = seconds
        self.applied: list[int] = []

    def clock(self) -> float:
        return self.now

    def step(self, tuner: ThreadTuner, num_tokens: int = 8) -> int:
        threads = tuner.choose(num_tokens)
        took = self.seconds[threads]
        self.now += took
        tuner.observed(num_tokens, threads, took)
        return threads


def run(machine: Machine, tuner: ThreadTuner, seconds: float, num_tokens: int = 8) -> list[int]:
    end, used = machine.now + seconds, []
    while machine.now < end:
        used.append(machine.step(tuner, num_tokens))
    return used


def test_all_threads_until_a_try_shows_one_thread_faster_under_contention_then_one():
    machine = Machine({2: 0.08, 1: 0.03})  # a neighbour on the cores: two threads wait at every barrier
    tuner = ThreadTuner(2, machine.applied.append, machine.clock)
    assert tuner.candidates == [2, 1]
    first = run(machine, tuner, EXPLORE_EVERY_S - 0.1)
    assert set(first) == {2} and machine.applied == []  # nothing changed until a try is due
    tried = run(machine, tuner, 1.0)
    switched = tried.index(1)  # the try, at 5 s
    assert switched <= 1 and set(tried[switched:]) == {1}  # and after it one thread is kept: faster
    machine.seconds = {2: 0.02, 1: 0.03}  # the neighbour left
    later = run(machine, tuner, MAX_EXPLORE_EVERY_S + 1.0)
    assert later[-1] == 2 and tuner.best(8) == 2  # tried again, and back to both


def test_a_change_in_what_else_runs_is_tried_at_once_not_at_the_next_periodic_try():
    machine = Machine({2: 0.02, 1: 0.04})  # quiet: two threads
    tuner = ThreadTuner(2, machine.applied.append, machine.clock)
    run(machine, tuner, 300.0)  # tries now MAX_EXPLORE_EVERY_S apart, all lost
    machine.seconds = {2: 0.08, 1: 0.03}  # a neighbour arrives: two threads four times slower
    started = machine.now
    used = run(machine, tuner, 5.0)
    switched = used.index(1)
    assert machine.now - started < MAX_EXPLORE_EVERY_S and set(used[switched:]) == {1}
    assert switched < 10  # within a few steps of the change, not at the next periodic try


def test_a_try_that_loses_comes_later_each_time_and_the_cost_stays_small():
    machine = Machine({2: 0.02, 1: 0.04})  # a quiet machine: two threads are twice as fast
    tuner = ThreadTuner(2, machine.applied.append, machine.clock)
    used = run(machine, tuner, 600.0)
    tries = [i for i, (a, b) in enumerate(zip([2] + used, used)) if (a, b) == (2, 1)]
    # 5, 10, 20, 40, 80, 80, ... s apart: 10 tries in ten minutes, each EXPLORE_STEPS steps
    assert len(tries) <= 4 + 600 / MAX_EXPLORE_EVERY_S
    assert used.count(1) / len(used) < 0.01
    assert tuner.best(8) == 2


def test_each_step_size_has_its_own_count_and_noise_does_not_switch():
    machine = Machine({2: 0.05, 1: 0.03})
    tuner = ThreadTuner(2, machine.applied.append, machine.clock)
    run(machine, tuner, 2 * EXPLORE_EVERY_S, num_tokens=8)
    assert tuner.best(8) == 1 and tuner.best(512) == 2  # a prefill's size class has not been tried yet
    machine.seconds = {2: 0.029, 1: 0.03}  # two threads a hair faster: within the margin, one is kept
    run(machine, tuner, 3 * EXPLORE_EVERY_S, num_tokens=8)
    assert tuner.best(8) == 1


def test_one_core_has_nothing_to_choose():
    machine = Machine({1: 0.03})
    tuner = ThreadTuner(1, machine.applied.append, machine.clock)
    assert set(run(machine, tuner, 60.0)) == {1} and machine.applied == []


class ResizingMachine(Machine):
    """As ``Machine``, and the first step after a change of count takes ``resize_s`` longer (threads woken)."""

    def __init__(self, seconds: dict[int, float], resize_s: float) -> None:
        super().__init__(seconds)
        self.resize_s = resize_s
        self.last: int | None = None

    def step(self, tuner: ThreadTuner, num_tokens: int = 8) -> int:
        threads = tuner.choose(num_tokens)
        took = self.seconds[threads] + (self.resize_s if self.last not in (None, threads) else 0.0)
        self.last = threads
        self.now += took
        tuner.observed(num_tokens, threads, took)
        return threads


def test_the_first_step_after_a_change_of_count_does_not_decide():
    # One thread is faster, but switching to it costs its first step 0.2 s: counted, it would lose every try.
    machine = ResizingMachine({2: 0.05, 1: 0.03}, resize_s=0.2)
    tuner = ThreadTuner(2, machine.applied.append, machine.clock)
    run(machine, tuner, EXPLORE_EVERY_S + 2.0)
    assert tuner.best(8) == 1

