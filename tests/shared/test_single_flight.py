"""One read at a time of a value many callers want at once (shared/single_flight.py)."""

from __future__ import annotations

import asyncio

import pytest

from switchyard.shared.single_flight import SingleFlight


async def test_callers_that_find_a_read_running_share_it_and_the_next_reads_again():
    reads: list[str] = []

    async def read(key: str) -> str:
        reads.append(key)
        await asyncio.sleep(0.01)
        return key.upper()

    flight: SingleFlight[str] = SingleFlight()
    answers = await asyncio.gather(*(flight.run(k, lambda k=k: read(k)) for k in ["a"] * 50 + ["b"] * 5))
    assert answers == ["A"] * 50 + ["B"] * 5 and reads == ["a", "b"]
    assert await flight.run("a", lambda: read("a")) == "A" and reads == ["a", "b", "a"]


async def test_a_failed_read_fails_every_caller_and_one_caller_leaving_leaves_the_read_to_the_others():
    flight: SingleFlight[int] = SingleFlight()

    async def failing() -> int:
        await asyncio.sleep(0.01)
        raise ConnectionError("away")

    results = await asyncio.gather(*(flight.run(None, failing) for _ in range(3)), return_exceptions=True)
    assert all(isinstance(r, ConnectionError) for r in results)

    async def slow() -> int:
        await asyncio.sleep(0.02)
        return 7

    leaving = asyncio.ensure_future(flight.run(None, slow))
    staying = asyncio.ensure_future(flight.run(None, slow))
    await asyncio.sleep(0.005)
    leaving.cancel()
    assert await staying == 7
    with pytest.raises(asyncio.CancelledError):
        await leaving
