"""A worker's deltas on a real NATS server: a step's deltas leave as one message per gateway, each request's
numbered in order and named by worker; a message never passes the server's max_payload; a request that names no
gateway gets one delta per message on its own subject, as a wire client subscribed per request expects."""

from __future__ import annotations

import time

import msgspec
import nats
import pytest

from switchyard.shared import nats_client, subjects
from switchyard.shared.messages import (
    ErrorInfo,
    GenerateRequest,
    RoutedDelta,
    SamplingParams,
    TokenDelta,
    decode,
    decode_routed,
    encode,
)
from switchyard.workers.service.publisher import Publisher, StepDeltas, messages_of


def _request(request_id: str, gateway: str | None) -> GenerateRequest:
    now = time.time()
    return GenerateRequest(request_id, "m", "pro", SamplingParams(), created_at=now, deadline_at=now + 30, prompt="x",
                           reply_subject=None if gateway is None else subjects.gateway_token_subject(gateway))


async def _all(sub) -> list[bytes]:
    got = []
    while True:
        try:
            got.append((await sub.next_msg(timeout=0.2)).data)
        except nats.errors.TimeoutError:
            return got


@pytest.fixture
async def nc(nats_url):
    nc = await nats.connect(nats_url)
    yield nc
    await nc.close()


async def test_a_steps_deltas_go_as_one_message_per_gateway_numbered_per_request(nc):
    g1, g2 = await nc.subscribe(subjects.gateway_token_subject("g1")), await nc.subscribe(
        subjects.gateway_token_subject("g2"))
    own = await nc.subscribe(subjects.token_subject("c"))
    out = Publisher(nc, None, "worker-1")
    a, b, c, d = _request("a", "g1"), _request("b", "g2"), _request("c", None), _request("d", "g1")
    for _ in range(2):  # two steps
        step = StepDeltas()
        for req in (a, b, c, d):
            await out.delta(req, TokenDelta(req.request_id, text=req.request_id, num_tokens=1), step)
        await out.send(step)
    await nats_client.settled(nc)
    got1, got2, got_own = await _all(g1), await _all(g2), await _all(own)
    assert len(got1) == len(got2) == 2 and len(got_own) == 2  # a message per gateway per step; c's one by one
    step1 = [(r.request_id, decode(r.delta, TokenDelta)) for r in decode_routed(got1[1])]
    assert [(rid, d.seq, d.worker_id) for rid, d in step1] == [("a", 1, "worker-1"), ("d", 1, "worker-1")]
    assert [decode(data, TokenDelta).seq for data in got_own] == [0, 1]


async def test_a_delta_outside_a_step_goes_at_once(nc):
    g = await nc.subscribe(subjects.gateway_token_subject("g"))
    out = Publisher(nc, None, "worker-1")
    await out.error(_request("r", "g"), ErrorInfo("boom", code="boom"))  # a refusal from the intake, say
    (routed,) = decode_routed((await g.next_msg(timeout=5)).data)
    delta = decode(routed.delta, TokenDelta)
    assert routed.request_id == "r" and delta.is_last and delta.error.code == "boom"


def test_a_step_too_large_for_one_message_is_split_in_order_and_a_huge_delta_goes_alone():
    deltas = [RoutedDelta(f"r{i}", msgspec.Raw(encode(TokenDelta(f"r{i}", text="x" * 100)))) for i in range(50)]
    deltas.insert(20, RoutedDelta("huge", msgspec.Raw(encode(TokenDelta("huge", text="y" * 5000)))))
    messages = messages_of(deltas, max_bytes=1000)
    assert len(messages) > 5
    assert all(len(m) <= 1000 for m in messages if not any(r.request_id == "huge" for r in decode_routed(m)))
    assert [r.request_id for m in messages for r in decode_routed(m)] == [r.request_id for r in deltas]
    (alone,) = [m for m in messages if any(r.request_id == "huge" for r in decode_routed(m))]
    assert len(decode_routed(alone)) == 1


async def test_a_stream_taken_over_tells_the_gateway_that_relayed_it_out_of_the_runs_numbering(nc):
    from switchyard.shared.messages import StreamResume
    from switchyard.workers.service.stream_replay import StreamReplays

    g1, g2 = await nc.subscribe(subjects.gateway_token_subject("g1")), await nc.subscribe(
        subjects.gateway_token_subject("g2"))
    out = Publisher(nc, None, "worker-1", StreamReplays("worker-1", started_at=time.monotonic()))
    req = msgspec.structs.replace(_request("r", "g1"), resumable_s=30.0, tenant_id="t")
    for _ in range(3):
        await out.delta(req, TokenDelta("r", text="x", num_tokens=1))
    answers = []

    async def respond(data: bytes) -> None:
        answers.append(data)

    await out.take_over(StreamResume("r", "t", subjects.gateway_token_subject("g2"), seq=1), respond)
    await out.delta(req, TokenDelta("r", text="y", num_tokens=1))  # later deltas go to the new gateway only
    await nats_client.settled(nc)
    (notice,) = [decode(r.delta, TokenDelta) for m in (await _all(g1))[3:] for r in decode_routed(m)]
    assert notice.is_last and notice.error.code == "stream_taken_over" and notice.seq == 3
    moved = [decode(r.delta, TokenDelta).seq for m in await _all(g2) for r in decode_routed(m)]
    assert len(answers) == 1 and moved == [1, 2, 3]  # the client's delta again, the next, then the later one


async def test_a_delta_sent_alone_while_a_step_holds_one_of_the_same_request_is_numbered_after_it(nc):
    """The order a gateway reads is the order of the numbers: a delta made in a step that has not gone out yet, and
    one sent alone meanwhile (an intake's answer for the same request id), arrive numbered as they were sent."""
    g = await nc.subscribe(subjects.gateway_token_subject("g"))
    out = Publisher(nc, None, "worker-1")
    req = _request("r", "g")
    step = StepDeltas()
    await out.delta(req, TokenDelta("r", text="a", num_tokens=1), step)  # the step's, not sent yet
    await out.delta(req, TokenDelta("r", text="b", num_tokens=1))  # alone, at once
    await out.send(step)
    await nats_client.settled(nc)
    got = [decode(r.delta, TokenDelta) for m in await _all(g) for r in decode_routed(m)]
    assert [(d.seq, d.text) for d in got] == [(0, "b"), (1, "a")]


async def test_a_runs_last_delta_ends_its_numbering(nc):
    """A request's last delta (or its error) ends its run: a later run of the same id (a copy delivered again)
    starts at 0, and the worker keeps no number for it."""
    g = await nc.subscribe(subjects.gateway_token_subject("g"))
    out = Publisher(nc, None, "worker-1")
    req = _request("r", "g")
    await out.delta(req, TokenDelta("r", text="a", num_tokens=1))
    await out.delta(req, TokenDelta("r", text="", is_last=True, finish_reason="stop"))
    await out.error(req, ErrorInfo("boom", code="boom"))
    await nats_client.settled(nc)
    got = [decode(r.delta, TokenDelta) for m in await _all(g) for r in decode_routed(m)]
    assert [d.seq for d in got] == [0, 1, 0]
