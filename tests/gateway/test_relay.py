"""The gateway's side of the token stream on a real NATS server: a lost or unreadable delta is reported, never
streamed over, and the worker is told to stop."""

from __future__ import annotations

import time
import uuid

import nats
import pytest

from switchyard.gateway.relay import RelayedRequest
from switchyard.shared import subjects
from switchyard.shared.messages import GenerateRequest, SamplingParams, TokenDelta, encode


def _delta(request_id: str, seq: int, text: str = "") -> bytes:
    return encode(TokenDelta(request_id, text=text, num_tokens=len(text), seq=seq))


@pytest.mark.parametrize("arriving,texts,code", [
    # seq 2 ("b") was lost on the way
    (lambda rid: [_delta(rid, 0), _delta(rid, 1, "a"), _delta(rid, 3, "c")], ["a"], "stream_gap"),
    (lambda rid: [_delta(rid, 0), b"\xc1 not msgpack"], [], "bad_worker_message"),
], ids=["gap", "undecodable"])
async def test_a_broken_token_stream_ends_the_request_with_an_error_and_a_cancel(nats_url, arriving, texts, code):
    nc = await nats.connect(nats_url)
    try:
        request = GenerateRequest(uuid.uuid4().hex, "m", "pro", SamplingParams(max_tokens=9), created_at=time.time(),
                                  deadline_at=time.time() + 30, prompt="x")
        sub = await nc.subscribe(subjects.token_subject(request.request_id))
        cancels = await nc.subscribe(subjects.cancel_subject(request.request_id))
        relayed = RelayedRequest(nc, request, sub, stall_timeout_s=10, retry_after_s=1)
        for data in arriving(request.request_id):
            await nc.publish(subjects.token_subject(request.request_id), data)
        await nc.flush()
        assert (await relayed.first()).seq == 0
        got = [d async for d in relayed.deltas()]
        assert [d.text for d in got[:-1]] == texts
        assert got[-1].error is not None and got[-1].error.code == code and relayed.is_finished
        await cancels.next_msg(timeout=5)  # the worker is told to stop
        await relayed.close()
    finally:
        await nc.close()
