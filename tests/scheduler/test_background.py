"""The background (batch) policy, on a fake clock."""

from __future__ import annotations

import pytest

from switchyard.scheduler.background import BackgroundPolicy


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_unlimited_until_interactive_traffic_then_limited_for_the_window():
    clock = Clock()
    policy = BackgroundPolicy(seats_when_busy=2, busy_window_s=10.0, clock=clock)
    assert policy.step_limit(False) is None and policy.may_take_background(30, False)
    policy.note_arrival(is_background=True)  # batch arrivals never turn the limit on
    assert policy.step_limit(False) is None

    policy.note_arrival(is_background=False)
    assert policy.step_limit(False) == 2
    assert policy.may_take_background(1, False) and not policy.may_take_background(2, False)
    clock.now += 9.9
    assert policy.step_limit(False) == 2
    clock.now += 0.2  # the window has passed and nothing interactive runs
    assert policy.step_limit(False) is None and policy.may_take_background(5, False)


def test_a_running_interactive_request_keeps_the_limit_on_past_the_window():
    clock = Clock()
    policy = BackgroundPolicy(seats_when_busy=1, busy_window_s=1.0, clock=clock)
    clock.now += 60
    assert policy.step_limit(interactive_running=True) == 1
    assert not policy.may_take_background(1, interactive_running=True)


def test_no_seat_limit_means_never_limited():
    policy = BackgroundPolicy(seats_when_busy=None, busy_window_s=10.0, clock=Clock())
    policy.note_arrival(is_background=False)
    assert policy.step_limit(True) is None and policy.may_take_background(100, True)


def test_a_limit_leaves_at_least_one_seat():
    with pytest.raises(ValueError, match="seats_when_busy"):
        BackgroundPolicy(seats_when_busy=0, busy_window_s=1.0)
