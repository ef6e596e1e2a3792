"""The gateway's side of the token stream on a real NATS server: a lost delta is reported, never streamed over."""

from __future__ import annotations

import time
import uuid

import nats

from switchyard.gateway.relay import RelayedRequest
from switchyard.shared import subjects
from switchyard.shared.messages import GenerateRequest, SamplingParams, TokenDelta, encode


async def test_a_gap_in_the_deltas_ends_the_request_with_an_error_and_a_cancel(nats_url):
    nc = await nats.connect(nats_url)
    try:
        request = GenerateRequest(uuid.uuid4().hex, "m", "pro", SamplingParams(max_tokens=9), created_at=time.time(),
                                  deadline_at=time.time() + 30, prompt="x")
        sub = await nc.subscribe(subjects.token_subject(request.request_id))
        cancels = await nc.subscribe(subjects.cancel_subject(request.request_id))
        relayed = RelayedRequest(nc, request, sub, stall_timeout_s=10, retry_after_s=1)
        for seq, text in ((0, ""), (1, "a"), (3, "c")):  # seq 2 ("b") was lost
            await nc.publish(subjects.token_subject(request.request_id),
                             encode(TokenDelta(request.request_id, text=text, num_tokens=len(text), seq=seq)))
        await nc.flush()
        assert (await relayed.first()).seq == 0
        got = [d async for d in relayed.deltas()]
        assert [d.text for d in got[:-1]] == ["a"]
        assert got[-1].error is not None and got[-1].error.code == "stream_gap" and relayed.is_finished
        await cancels.next_msg(timeout=5)  # the worker is told to stop
        await relayed.close()
    finally:
        await nc.close()


async def test_an_undecodable_delta_ends_the_request_with_an_error(nats_url):
    nc = await nats.connect(nats_url)
    try:
        request = GenerateRequest(uuid.uuid4().hex, "m", "pro", SamplingParams(max_tokens=9), created_at=time.time(),
                                  deadline_at=time.time() + 30, prompt="x")
        sub = await nc.subscribe(subjects.token_subject(request.request_id))
        relayed = RelayedRequest(nc, request, sub, stall_timeout_s=10, retry_after_s=1)
        await nc.publish(subjects.token_subject(request.request_id), encode(TokenDelta(request.request_id)))
        await nc.publish(subjects.token_subject(request.request_id), b"\xc1 not msgpack")
        await nc.flush()
        await relayed.first()
        got = [d async for d in relayed.deltas()]
        assert len(got) == 1 and got[0].error.code == "bad_worker_message" and relayed.is_finished
        await relayed.close()
    finally:
        await nc.close()
