"""A worker's pulls from its per-tenant queues (workers/service/pulls.py, tenant_queues.py) on a real JetStream:
one subscription whatever the number of tenants, an empty queue answered by the server, a consumer deleted while
idle made again, messages acked and redelivered as JetStream's own."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path

import nats
import pytest

from switchyard.deploy.launcher import NatsServer
from switchyard.shared import subjects
from switchyard.shared.jetstream import ensure_request_consumer, ensure_streams
from switchyard.workers.service.pulls import ConsumerGone, ConsumerPulls
from switchyard.workers.service.tenant_queues import TenantQueues

MODEL = "m"
TIER = "pro"


@pytest.fixture
async def nc():
    """A connection to a fresh JetStream server with the request streams made; closed, and the server stopped."""
    path = Path(tempfile.mkdtemp(prefix="switchyard-test-pulls-"))
    try:
        with NatsServer(path / "nats") as server:
            conn = await nats.connect(server.url)
            try:
                await ensure_streams(conn.jetstream())
                yield conn
            finally:
                await conn.close()
    finally:
        shutil.rmtree(path)


async def until_pulled(pulls: ConsumerPulls, stream: str, consumer: str, within_s: float = 10.0):
    """The consumer's next message, pulled again until it is there (a nak'd message comes back a moment later)."""
    deadline = asyncio.get_running_loop().time() + within_s
    while (msg := await pulls.next(stream, consumer, timeout_s=5.0)) is None:
        assert asyncio.get_running_loop().time() < deadline, "never redelivered"
        await asyncio.sleep(0.01)
    return msg


def subscriptions(nc) -> int:
    return len(nc._subs)  # the client's own table: what the server holds for this connection


async def test_one_subscription_serves_more_tenants_than_a_worker_ever_subscribed(nc):
    js = nc.jetstream()
    tenants = [f"t{i:04d}" for i in range(300)]
    for tenant in tenants:
        await js.publish(subjects.request_subject(MODEL, TIER, tenant), tenant.encode())
    queues = TenantQueues(nc, js, MODEL, [TIER])
    before = subscriptions(nc)
    await queues.sweep()
    got = []
    while (msg := await queues.take(TIER, timeout_s=5.0)) is not None:
        got.append(msg.data.decode())
        await msg.ack_sync()
    assert sorted(got) == tenants  # each tenant's request once, none lost
    assert subscriptions(nc) - before == 1  # one inbox for all 300 consumers (a worker kept one per tenant)
    assert (await js.stream_info(subjects.request_stream(TIER))).state.messages == 0  # acked: gone
    assert not queues.has_pending()  # every queue that came up empty is forgotten until it rings
    await queues.close()


async def test_an_empty_queue_is_answered_and_a_deleted_consumer_is_made_again(nc):
    js = nc.jetstream()
    stream = subjects.request_stream(TIER)
    consumer = await ensure_request_consumer(js, MODEL, TIER, "a")
    pulls = ConsumerPulls(nc)
    # Empty: the server says so (when the pull expires); a 30 s bound shows it is the answer, not the timeout,
    # that ends it.
    assert await asyncio.wait_for(pulls.next(stream, consumer, timeout_s=30.0), 10.0) is None
    await js.delete_consumer(stream, consumer)
    with pytest.raises(ConsumerGone):
        await pulls.next(stream, consumer, timeout_s=30.0)

    # Through the queues: the consumer JetStream deleted (idle for ten minutes, say) is made again on the next pull.
    queues = TenantQueues(nc, js, MODEL, [TIER])
    await js.publish(subjects.request_subject(MODEL, TIER, "a"), b"first")
    await queues.sweep()
    first = await queues.take(TIER, timeout_s=5.0)
    await first.ack_sync()
    await js.delete_consumer(stream, consumer)
    await js.publish(subjects.request_subject(MODEL, TIER, "a"), b"second")
    queues.ring(subjects.request_subject(MODEL, TIER, "a"))
    second = await queues.take(TIER, timeout_s=5.0)
    assert (first.data, second.data) == (b"first", b"second")
    await queues.close()
    await pulls.close()


async def test_a_pulled_message_is_jetstreams_own_nak_redelivers_and_in_progress_holds(nc):
    js = nc.jetstream()
    stream = subjects.request_stream(TIER)
    consumer = await ensure_request_consumer(js, MODEL, TIER, "a")
    await js.publish(subjects.request_subject(MODEL, TIER, "a"), b"job")
    pulls = ConsumerPulls(nc)
    msg = await pulls.next(stream, consumer, timeout_s=5.0)
    assert msg.metadata.num_delivered == 1
    await msg.in_progress()
    await msg.nak()
    again = await until_pulled(pulls, stream, consumer)
    assert (again.data, again.metadata.num_delivered) == (b"job", 2)
    await again.ack_sync()
    assert await pulls.next(stream, consumer, timeout_s=5.0) is None
    await pulls.close()


async def test_free_seats_are_filled_from_the_least_served_tenants_one_request_each(nc):
    js = nc.jetstream()
    tenants = [f"t{i:02d}" for i in range(12)]
    for tenant in tenants:
        for n in range(2):
            await js.publish(subjects.request_subject(MODEL, TIER, tenant), f"{tenant}/{n}".encode())
    queues = TenantQueues(nc, js, MODEL, [TIER])
    await queues.sweep()
    for tenant in tenants[:4]:  # served before: they come last
        queues.charge(TIER, tenant, prompt_tokens=100)
    first = await queues.take_many(TIER, 8, timeout_s=5.0)
    assert sorted(m.data.decode() for m in first) == [f"{t}/0" for t in tenants[4:]]  # 8 tenants, one each
    rest = await queues.take_many(TIER, 100, timeout_s=5.0, excluded={subjects.tenant_token("t00")})
    assert sorted(m.data.decode() for m in rest) == sorted(
        [f"{t}/1" for t in tenants[4:]] + [f"{t}/0" for t in tenants[1:4]])  # t00 excluded; one each again
    for msg in first + rest:
        await msg.ack_sync()
    await queues.close()


class CountedPulls:
    """Wraps a TenantQueues' pulls: counts them, and runs ``after(stream, consumer, msg)`` once each answers."""

    def __init__(self, queues: TenantQueues, after=None) -> None:
        self.count, self._next, self._after = 0, queues._pulls.next, after
        queues._pulls.next = self.next

    async def next(self, stream, consumer, timeout_s):
        self.count += 1
        msg = await self._next(stream, consumer, timeout_s)
        if self._after is not None:
            await self._after(stream, consumer, msg)
        return msg


async def take_one(queues: TenantQueues):
    (msg,) = await queues.take_many(TIER, 1, timeout_s=5.0)
    return msg


async def ack_and_close(queues: TenantQueues, *msgs) -> None:
    for msg in msgs:
        await msg.ack_sync()
    await queues.close()


async def test_a_tenant_whose_last_request_was_taken_costs_the_next_pull_nothing(nc):
    # Thirty tenants with a request each (rung, as published), one seat freeing at a time: a tenant JetStream said
    # had nothing left after the request it handed out is not asked again. An empty answer waits out the pull's
    # expiry, and the intake pulls for nobody else meanwhile: the next tenant to ring waited for it.
    js = nc.jetstream()
    tenants = [f"t{i:02d}" for i in range(30)]
    queues = TenantQueues(nc, js, MODEL, [TIER])
    for tenant in tenants:
        subject = subjects.request_subject(MODEL, TIER, tenant)
        await js.publish(subject, tenant.encode())
        queues.ring(subject)
    pulls = CountedPulls(queues)
    got = []
    for _ in tenants:
        (msg,) = await queues.take_many(TIER, 1, timeout_s=5.0)
        got.append(msg.data.decode())
        await msg.ack_sync()
    assert sorted(got) == tenants
    assert pulls.count == len(tenants)  # not one empty answer on the way
    assert not queues.has_pending()
    await queues.close()


async def test_a_tenant_that_rang_more_often_than_it_was_served_is_asked_again_though_its_count_says_none(nc):
    # Two doorbells, and only the first request in the stream when it is pulled (a doorbell can come before the
    # stream hands its request to the consumer): the count in the answer says none left, but the second bell has
    # no request yet, so the tenant stays in the order and its second request is taken, not left for a sweep.
    js = nc.jetstream()
    subject = subjects.request_subject(MODEL, TIER, "a")
    queues = TenantQueues(nc, js, MODEL, [TIER])
    await js.publish(subject, b"first")
    queues.ring(subject)
    queues.ring(subject)  # the second request's bell, its request not in the stream yet
    first = await take_one(queues)
    assert (first.data, first.metadata.num_pending) == (b"first", 0)
    assert queues.has_work(TIER, set())
    await js.publish(subject, b"second")
    second = await take_one(queues)
    assert second.data == b"second"
    assert not queues.has_work(TIER, set())  # both bells answered, and none left: out of the order
    await ack_and_close(queues, first, second)


async def test_a_request_that_rings_after_the_count_was_taken_is_not_forgotten(nc):
    # Found by a sweep (no doorbell), its one request handed out with none left; meanwhile another request rang.
    js = nc.jetstream()
    subject = subjects.request_subject(MODEL, TIER, "a")
    await js.publish(subject, b"first")
    queues = TenantQueues(nc, js, MODEL, [TIER])
    await queues.sweep()

    async def another_comes(stream, consumer, msg):  # the count in the answer (0 left) predates this request
        if msg is not None and msg.data == b"first":
            await js.publish(subject, b"second")
            queues.ring(subject)

    CountedPulls(queues, another_comes)
    first = await take_one(queues)
    assert first.metadata.num_pending == 0
    assert queues.has_work(TIER, set())  # the newer ring wins over the older count
    second = await take_one(queues)
    assert (first.data, second.data) == (b"first", b"second")
    await ack_and_close(queues, first, second)


async def test_a_sweep_does_not_bring_back_a_tenant_for_requests_this_worker_took_and_holds(nc):
    # The stream counts a request until it is acknowledged; one this worker took and is preparing is not there to be
    # pulled, and asking for it again would only wait out an empty answer.
    js = nc.jetstream()
    subject = subjects.request_subject(MODEL, TIER, "a")
    await js.publish(subject, b"only")
    await js.publish(subjects.request_subject(MODEL, TIER, "b"), b"queued")
    queues = TenantQueues(nc, js, MODEL, [TIER])
    await queues.sweep()
    msgs = await queues.take_many(TIER, 2, timeout_s=5.0, excluded={subjects.tenant_token("b")})
    assert [m.data for m in msgs] == [b"only"]
    await queues.sweep(taken_subjects=[msgs[0].subject])
    assert not queues.has_work(TIER, {subjects.tenant_token("b")})  # a's one request is held here
    assert queues.has_work(TIER, set())  # b's is still queued
    await queues.sweep()
    assert queues.has_work(TIER, {subjects.tenant_token("b")})  # without the worker's word, the count stands
    await msgs[0].ack_sync()
    await queues.close()


async def test_a_request_that_rings_while_its_queue_answers_empty_is_not_forgotten(nc):
    # The pull expired empty, but the tenant rang meanwhile: its request reached the stream after the pull gave up,
    # and it is asked for again now, not after the next sweep.
    js = nc.jetstream()
    subject = subjects.request_subject(MODEL, TIER, "a")
    queues = TenantQueues(nc, js, MODEL, [TIER])
    queues.ring(subject)  # a bell, its message not in the stream yet

    async def it_arrives(stream, consumer, msg):
        if msg is None:
            await js.publish(subject, b"late")
            queues.ring(subject)

    CountedPulls(queues, it_arrives)
    assert await queues.take_many(TIER, 1, timeout_s=5.0) == []
    assert queues.has_work(TIER, set())  # the newer ring wins over the empty answer
    (msg,) = await queues.take_many(TIER, 1, timeout_s=5.0)
    assert msg.data == b"late"
    await msg.ack_sync()
    await queues.close()


async def test_a_tenant_that_rings_while_a_pull_is_out_is_asked_next_not_after_the_first_order(nc):
    # Tenants the worker believes have work (they rang; their requests went elsewhere) and that were served a lot,
    # ahead of a light tenant that rings while the first of them is being asked: the next round asks it.
    js = nc.jetstream()
    queues = TenantQueues(nc, js, MODEL, [TIER])
    stale = [f"s{i:02d}" for i in range(20)]
    for tenant in stale:
        queues.ring(subjects.request_subject(MODEL, TIER, tenant))
        queues.finished(TIER, tenant, prompt_tokens=100, generated_tokens=400)
    light = subjects.request_subject(MODEL, TIER, "light")

    async def light_comes(stream, consumer, msg):
        if pulls.count == 1:
            await js.publish(light, b"light")
            queues.ring(light)

    pulls = CountedPulls(queues, light_comes)
    (msg,) = await queues.take_many(TIER, 1, timeout_s=5.0)
    assert msg.data == b"light"
    assert pulls.count == 2  # one stale tenant asked, then the light one: not the nineteen others first
    await msg.ack_sync()
    await queues.close()


async def test_one_tenants_burst_fills_free_seats_a_batch_per_pull_within_its_bytes(nc):
    """A tenant with many cheap requests queued is asked for more at once (no_wait: nothing held open, nothing to
    hand back), as many as the seats to fill; after a costly request (a grammar) it is not, and a batch's bytes are
    bounded (so is what it hands the worker to prepare)."""
    from switchyard.shared.messages import GenerateRequest, ResponseFormat, SamplingParams, decode, encode
    from switchyard.workers.service.pulls import MORE_MAX_BYTES

    def request(n: int, prompt: str = "", **fields) -> bytes:
        return encode(GenerateRequest(f"r{n}", MODEL, TIER, SamplingParams(), created_at=0.0, deadline_at=1e18,
                                      prompt=prompt or f"burst {n}", **fields))

    def number(msg) -> int:
        return int(decode(msg.data, GenerateRequest).prompt.split()[1])

    js = nc.jetstream()
    for n in range(40):
        await js.publish(subjects.request_subject(MODEL, TIER, "burst"), request(n))
    queues = TenantQueues(nc, js, MODEL, [TIER])
    await queues.sweep()
    pulled = CountedPulls(queues)
    first = await queues.take_many(TIER, 16, timeout_s=5.0)
    assert [number(m) for m in first] == list(range(16))  # in order, none twice
    assert pulled.count == 1  # one pull for the first, one `more` for the other 15
    rest = await queues.take_many(TIER, 100, timeout_s=5.0)
    assert [number(m) for m in rest] == list(range(16, 40))
    await ack_and_close(queues, *first, *rest)

    costly = ResponseFormat(type="json_object")
    for n in range(4):
        await js.publish(subjects.request_subject(MODEL, TIER, "costly"), request(n, response_format=costly))
    long = "burst 0 " + "x" * (MORE_MAX_BYTES * 2 // 3)  # cheap to prepare, but two are over a batch's bytes
    for n in range(4):
        await js.publish(subjects.request_subject(MODEL, TIER, "long"), request(n, prompt=long))
    queues = TenantQueues(nc, js, MODEL, [TIER])
    await queues.sweep()
    taken = await queues.take_many(TIER, 16, timeout_s=5.0)
    by_tenant = {t: sum(m.subject.endswith(subjects.tenant_token(t)) for m in taken) for t in ("costly", "long")}
    assert by_tenant == {"costly": 1, "long": 2}
    await ack_and_close(queues, *taken)


async def test_a_pull_that_would_pause_a_seat_takes_only_a_tenant_ahead_of_every_pausable_holder(nc):
    """With every seat taken, a pull for pausing (workers/service/capacity.py) is for a tenant far behind in the
    tier's fair share, not for one level with the tenants running (scheduler/pausing.ahead_in_share)."""
    js = nc.jetstream()
    queues = TenantQueues(nc, js, MODEL, [TIER])
    holder, busy, light = (subjects.tenant_token(t) for t in ("holder", "busy", "light"))
    queues.charge(TIER, "holder", generated_tokens=300)  # running, past the quantum: served 600
    queues.charge(TIER, "busy", generated_tokens=250)  # waiting after a long request: its next one would end at 1,300
    queues.finished(TIER, "busy", 0, 400)
    queues.finished(TIER, "light", 0, 8)  # short requests: its next one would end at 16
    await js.publish(subjects.request_subject(MODEL, TIER, "busy"), b"busy")
    await queues.sweep()
    assert queues.has_work(TIER, frozenset({holder}))  # an ordinary pull would take busy's
    assert not queues.has_work(TIER, frozenset({holder}), False, frozenset({holder}))
    assert await queues.take_many(TIER, 1, 5.0, frozenset({holder}), False, frozenset({holder})) == []
    await js.publish(subjects.request_subject(MODEL, TIER, "light"), b"light")
    await queues.sweep()
    assert queues.has_work(TIER, frozenset({holder}), False, frozenset({holder}))
    (msg,) = await queues.take_many(TIER, 1, 5.0, frozenset({holder}), False, frozenset({holder}))
    assert msg.data == b"light" and busy in queues._pending[TIER] and light not in queues._pending[TIER]
    await msg.ack_sync()
    await queues.close()
