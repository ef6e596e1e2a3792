"""Calls about one key gathered into one statement while the last one runs (domain/grouped_calls.py), on a
stand-in pool: what goes together, in which order, and what a caller that left is owed."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.domain.database import Database, DatabaseUnavailable
from switchyard.domain.grouped_calls import GroupedCalls


class Pool:
    """Just what Database asks of a pool."""

    def get_max_size(self) -> int:
        return 4


class Recorder:
    """A statement that answers each item doubled after ``delay_s``, recording each group it was given."""

    def __init__(self, delay_s: float = 0.01, fail: bool = False) -> None:
        self.groups: list[tuple[str, list[int]]] = []
        self.delay_s, self.fail = delay_s, fail

    async def __call__(self, pool, key: str, items: list[int]) -> list[int]:
        self.groups.append((key, list(items)))
        await asyncio.sleep(self.delay_s)
        if self.fail:
            raise DatabaseUnavailable
        return [2 * i for i in items]


async def test_calls_that_arrive_while_a_statement_runs_go_together_in_order():
    statement = Recorder()
    calls = GroupedCalls(Database(Pool()), statement)
    first = asyncio.ensure_future(calls.call("a", 0))
    await asyncio.sleep(0.001)  # its statement runs
    results = await asyncio.gather(*(calls.call("a", i) for i in range(1, 100)),
                                   *(calls.call("b", i) for i in range(3)))
    assert await first == 0 and results == [2 * i for i in range(1, 100)] + [0, 2, 4]
    assert statement.groups == [("a", [0]), ("b", [0, 1, 2]), ("a", list(range(1, 100)))]
    assert not calls._waiting  # nothing left behind for a key nobody calls about


async def test_a_failed_statement_fails_each_of_its_calls_and_the_next_goes_on():
    statement = Recorder(fail=True)
    calls = GroupedCalls(Database(Pool()), statement)
    results = await asyncio.gather(*(calls.call("a", i) for i in range(5)), return_exceptions=True)
    assert all(isinstance(r, DatabaseUnavailable) for r in results)
    statement.fail = False
    calls = GroupedCalls(Database(Pool()), statement)  # a fresh breaker: the first failure opened this one's
    assert await calls.call("a", 7) == 14


async def test_a_caller_gone_before_its_statement_is_left_out_and_one_gone_during_it_is_undone():
    statement = Recorder(delay_s=0.05)
    undone: list[tuple[str, int, int]] = []

    async def abandoned(key: str, item: int, result: int) -> None:
        undone.append((key, item, result))

    calls = GroupedCalls(Database(Pool()), statement, abandoned=abandoned)
    first = asyncio.ensure_future(calls.call("a", 1))  # its statement starts at once
    await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(calls.call("a", 2))  # waits for the next statement
    await asyncio.sleep(0)
    first.cancel()
    waiting.cancel()
    assert await calls.call("a", 3) == 6
    assert [items for _, items in statement.groups] == [[1], [3]]  # 2 never went
    assert undone == [("a", 1, 2)]
    with pytest.raises(asyncio.CancelledError):
        await first
