"""The seat rule alone: who may take a running request's seat when every seat is taken."""

from __future__ import annotations

from switchyard.scheduler.seats import SEAT_GAP, TenantSeats, outranks


def test_only_a_strictly_more_important_request_outranks():
    assert outranks(0, 1) and not outranks(1, 1) and not outranks(2, 1)


def test_a_tenant_takes_a_seat_only_two_apart_from_the_holder():
    seats = TenantSeats(["heavy"] * 3 + ["light"])
    assert seats.most == 3 and seats.holder() == "heavy"
    assert seats.may_take("new") and seats.may_take("light") and not seats.may_take("heavy")
    assert seats.may_not_take() == {"heavy"}  # and anyone holding none may
    assert TenantSeats(["heavy"] * 3 + ["light"] * 2).may_not_take() == {"heavy", "light"}


def test_at_one_apart_nothing_moves():
    seats = TenantSeats(["a", "a", "b"])
    assert not seats.may_take("b")
    assert seats.may_take("c")  # holding none: two apart from a


def test_with_nobody_holding_the_gap_no_tenant_may_take_one():
    seats = TenantSeats(["a"] * (SEAT_GAP - 1) + ["b"])
    assert not seats.may_take_any() and seats.may_not_take() is None
    empty = TenantSeats([])
    assert empty.holder() is None and empty.most == 0 and empty.may_not_take() is None


def test_equal_holders_give_up_the_greatest_name_first():
    assert TenantSeats(["b", "b", "a", "a"]).holder() == "b"


def test_the_seats_holders_would_give_up_leave_each_one_short_of_the_gap():
    assert TenantSeats(["a", "a", "b"]).num_to_give() == 1  # a gives one; at one each nothing moves
    assert TenantSeats(["a"] * 5 + ["b"] * 2 + ["c"]).num_to_give() == 4 + 1
    assert TenantSeats(["a", "b", "c"]).num_to_give() == 0
