"""A gateway's token subject on a real NATS server: each delta of a worker's step message reaches its own
request's inbox, in order; a waiting reader is woken by its next delta; what is no longer relayed, or cannot be
read, is dropped without holding up the others."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import pytest

from switchyard.gateway import token_router
from switchyard.gateway.token_router import TokenRouter
from switchyard.shared.messages import RoutedDelta, TokenDelta, decode, encode


def _step(*items: tuple[str, str]) -> bytes:
    """A worker's step message: ``(request_id, text)`` deltas in that order."""
    return encode([RoutedDelta(rid, msgspec.Raw(encode(TokenDelta(rid, text=text)))) for rid, text in items])


async def _texts(inbox, n: int) -> list[str]:
    return [decode(await inbox.next(5), TokenDelta).text for _ in range(n)]


@pytest.fixture
async def router(nats_url, monkeypatch):
    monkeypatch.setattr(token_router, "IDLE_TICK_S", 0.05)
    nc = await nats.connect(nats_url)
    router = TokenRouter(nc)
    await router.start()
    try:
        yield nc, router
    finally:
        await router.stop()
        await nc.close()


async def test_each_request_gets_its_own_deltas_in_order_and_an_unknown_ones_are_dropped(router):
    nc, router = router
    a, b = router.open("a"), router.open("b")
    await nc.publish(router.subject, _step(("a", "1"), ("gone", "x"), ("b", "one"), ("a", "2")))
    await nc.publish(router.subject, _step(("b", "two"), ("a", "3")))
    assert await _texts(a, 3) == ["1", "2", "3"]
    assert await _texts(b, 2) == ["one", "two"]
    assert a.pending == b.pending == 0 and a.pending_bytes == b.pending_bytes == 0


async def test_a_waiting_reader_is_woken_by_its_delta_and_one_with_none_times_out(router):
    nc, router = router
    inbox, quiet = router.open("r"), router.open("quiet")
    reading = asyncio.ensure_future(inbox.next(10))
    await asyncio.sleep(0)  # the reader waits now
    await nc.publish(router.subject, _step(("r", "late")))
    assert decode(await asyncio.wait_for(reading, 5), TokenDelta).text == "late"
    with pytest.raises(TimeoutError):
        await quiet.next(0.05)


async def test_a_reader_waiting_with_no_timeout_of_its_own_is_woken_by_the_idle_tick(router):
    nc, router = router
    inbox = router.open("idle")
    for _ in range(3):  # woken each tick while nothing comes, so it can look around (its worker's liveness)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(inbox.next(), 5)

    async def read_through_ticks():  # as a stream does: look around at each tick, then wait on
        while True:
            try:
                return await inbox.next()
            except TimeoutError:
                continue

    reading = asyncio.ensure_future(read_through_ticks())
    await nc.publish(router.subject, _step(("idle", "at last")))
    assert decode(await asyncio.wait_for(reading, 5), TokenDelta).text == "at last"


async def test_waiting_deltas_are_counted_in_bytes_until_taken(router):
    nc, router = router
    inbox = router.open("slow")
    await nc.publish(router.subject, _step(("slow", "x" * 1000), ("slow", "y" * 1000)))
    await nc.flush()
    first = await inbox.next(5)
    assert inbox.pending == 1 and len(first) + inbox.pending_bytes > 2000 and inbox.pending_bytes > 1000


async def test_a_closed_inbox_gets_nothing_more_and_a_bad_message_spoils_no_other(router):
    nc, router = router
    closed, open_ = router.open("closed"), router.open("open")
    await closed.close()
    await nc.publish(router.subject, b"\xc1 not a step message")
    await nc.publish(router.subject, _step(("closed", "x"), ("open", "still here")))
    assert await _texts(open_, 1) == ["still here"]
    assert closed.pending == 0 and router.num_open == 1


async def test_an_inbox_displaced_by_a_take_over_that_failed_is_routed_to_again_with_what_it_missed(router):
    nc, router = router
    running = router.open("r")  # the run this gateway relays
    taking_over = router.open("r")  # its client resumes here, and the take-over waits for the worker's answer
    await nc.publish(router.subject, _step(("r", "1"), ("r", "2")))
    await nc.flush()
    assert taking_over.pending == 2 and running.pending == 0
    await taking_over.close()  # no answer: the take-over failed
    await nc.publish(router.subject, _step(("r", "3")))
    assert await _texts(running, 3) == ["1", "2", "3"]  # all of it, in order: the run hears its worker again
    await running.close()
    assert router.num_open == 0


async def test_a_displaced_inbox_is_still_ticked_and_one_closed_first_is_not_routed_to_again(router):
    nc, router = router
    running = router.open("r")
    taking_over = router.open("r")
    reading = asyncio.ensure_future(running.next())
    done, _ = await asyncio.wait({reading}, timeout=5)  # its reader is woken each tick, to look after its worker
    assert reading in done and isinstance(reading.exception(), TimeoutError)
    await running.close()  # it ended (told of the take-over): the new inbox alone is routed to, and then none
    await nc.publish(router.subject, _step(("r", "x")))
    assert await _texts(taking_over, 1) == ["x"]
    await taking_over.close()
    assert router.inbox_of("r") is None and running.pending == 0
