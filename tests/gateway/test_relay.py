"""The gateway's side of the token stream on a real NATS server: a lost or unreadable delta is reported, never
streamed over, and the worker is told to stop; with a failover, a stream with a hole goes on from what the client
has."""

from __future__ import annotations

import time
import uuid

import msgspec
import nats
import pytest

from switchyard.gateway.relayed_request import RelayedRequest
from switchyard.gateway.token_router import TokenRouter
from switchyard.shared import nats_client, subjects
from switchyard.shared.messages import (
    ErrorInfo,
    GenerateRequest,
    Resume,
    RoutedDelta,
    SamplingParams,
    TokenDelta,
    Usage,
    encode,
)


def _delta(request_id: str, seq: int, text: str = "") -> bytes:
    return encode(TokenDelta(request_id, text=text, num_tokens=len(text), seq=seq))


def _routed(request_id: str, data: bytes) -> bytes:
    """One delta as a worker sends it to a gateway (alone in its step's message)."""
    return encode([RoutedDelta(request_id, msgspec.Raw(data))])


@pytest.mark.parametrize("arriving,texts,code", [
    # seq 2 ("b") was lost on the way
    (lambda rid: [_delta(rid, 0), _delta(rid, 1, "a"), _delta(rid, 3, "c")], ["a"], "stream_gap"),
    (lambda rid: [_delta(rid, 0), msgspec.msgpack.encode(["not", "a delta"])], [], "bad_worker_message"),
], ids=["gap", "undecodable"])
async def test_a_broken_token_stream_ends_the_request_with_an_error_and_a_cancel(nats_url, arriving, texts, code):
    nc = await nats.connect(nats_url)
    try:
        request = GenerateRequest(uuid.uuid4().hex, "m", "pro", SamplingParams(max_tokens=9), created_at=time.time(),
                                  deadline_at=time.time() + 30, prompt="x")
        router = TokenRouter(nc)
        await router.start()
        cancels = await nc.subscribe(subjects.cancel_subject(request.request_id))
        relayed = RelayedRequest(nc, request, router.open(request.request_id), stall_timeout_s=10, retry_after_s=1)
        for data in arriving(request.request_id):
            await nc.publish(router.subject, _routed(request.request_id, data))
        await nats_client.settled(nc)
        assert (await relayed.first()).seq == 0
        got = [d async for d in relayed.deltas()]
        assert [d.text for d in got[:-1]] == texts
        assert got[-1].error is not None and got[-1].error.code == code and relayed.is_finished
        await cancels.next_msg(timeout=5)  # the worker is told to stop
        await relayed.close()
    finally:
        await nc.close()


class RecordingFailover:
    """A failover that always finds a worker: records what it was asked to continue from."""

    def __init__(self) -> None:
        self.asked: list[tuple[str | None, list[int], int]] = []
        self.billed: list[int] = []

    async def continue_elsewhere(self, request, dead_worker, token_ids, text_len):
        self.asked.append((dead_worker, list(token_ids), text_len))
        return msgspec.structs.replace(request, resume=Resume(list(token_ids), text_len, len(self.asked)))

    async def bill_lost(self, request, worker_id, prompt_tokens, completion_tokens, taken_at, first_token_at):
        self.billed.append(completion_tokens)


async def _relayed_with(nc, failover) -> tuple[str, TokenRouter, RelayedRequest]:
    """A request relayed with ``failover`` through a started token router on ``nc``: its id, the router, the
    relayed request."""
    request = GenerateRequest(uuid.uuid4().hex, "m", "pro", SamplingParams(max_tokens=9), created_at=time.time(),
                              deadline_at=time.time() + 30, prompt="x")
    router = TokenRouter(nc)
    await router.start()
    relayed = RelayedRequest(nc, request, router.open(request.request_id), stall_timeout_s=10, retry_after_s=1,
                             failover=failover)
    return request.request_id, router, relayed


class NowhereFailover(RecordingFailover):
    """A failover that finds no worker to go on on."""

    async def continue_elsewhere(self, request, dead_worker, token_ids, text_len):
        return None


async def test_a_stream_that_cannot_go_on_tells_its_client_what_was_billed_for_it(nats_url):
    nc = await nats.connect(nats_url)
    try:
        failover = NowhereFailover()
        rid, router, relayed = await _relayed_with(nc, failover)
        for data in [encode(TokenDelta(rid, seq=0, prompt_tokens=5)), encode(TokenDelta(rid, "ab", 2, seq=1)),
                     _delta(rid, 3, "c")]:  # seq 2 never came
            await nc.publish(router.subject, _routed(rid, data))
        await nats_client.settled(nc)
        await relayed.first()
        got = [d async for d in relayed.deltas()]
        assert got[-1].error is not None and got[-1].error.code == "stream_gap"
        # What this gateway billed (the worker, told to stop, bills nothing) is what its client is told it used.
        assert failover.billed == [2] and got[-1].usage == Usage(prompt_tokens=5, completion_tokens=2)
        await relayed.close()
    finally:
        await nc.close()


async def test_a_stream_with_a_hole_goes_on_from_what_the_client_has_and_the_old_run_is_ignored(nats_url):
    nc = await nats.connect(nats_url)
    try:
        failover = RecordingFailover()
        rid, router, relayed = await _relayed_with(nc, failover)
        cancels = await nc.subscribe(subjects.cancel_subject(rid))

        def delta(seq, text="", ids=(), attempt=0, worker="w1", **kw):
            return encode(TokenDelta(rid, text=text, num_tokens=len(ids), seq=seq, token_ids=list(ids) or None,
                                     attempt=attempt, worker_id=worker, **kw))

        for data in [delta(0), delta(1, "ab", [7, 8]), delta(3, "lost-before", [9]),  # seq 2 never came
                     delta(4, "late", [10]),  # the first run goes on a moment: ignored
                     delta(0, worker="w1", attempt=1), delta(1, "c", [11], attempt=1, worker="w1"),
                     delta(2, "d", [12], attempt=1, worker="w1", finish_reason="length", is_last=True)]:
            await nc.publish(router.subject, _routed(rid, data))
        await nats_client.settled(nc)
        await relayed.first()
        got = [d async for d in relayed.deltas()]
        assert "".join(d.text for d in got) == "abcd" and got[-1].finish_reason == "length"
        assert failover.asked == [(None, [7, 8], 2)]  # any worker (w1 too), from the ids and text the client has
        assert (await cancels.next_msg(timeout=5)).data == b"w1:0"  # the broken run (attempt 0) is told to stop
        assert failover.billed == []  # the continuation bills everything
        await relayed.close()
    finally:
        await nc.close()


@pytest.mark.parametrize("code, status, billed, told", [
    ("stream_taken_over", 409, [], "stream_taken_over"),
    ("internal_error", 500, [3], "internal_error"),
    ("unsupported_parameter", 400, [3], "worker_lost"),  # a worker that cannot resume this kind of request
    ("queue_timeout", 503, [3], "worker_lost"),  # taken past its deadline
], ids=["handed-off", "failed", "refused", "expired"])
async def test_a_continuation_handed_off_to_another_gateway_is_not_billed_here_one_that_failed_is(
        nats_url, code, status, billed, told):
    """After a failover, an error ending the continuation bills what streamed here, and the client is told that
    usage; the worker's notice that another gateway took the stream over does not (it goes on there, and its worker
    bills it). A continuation refused is the worker's loss to the client, not a fault of its request."""
    nc = await nats.connect(nats_url)
    try:
        failover = RecordingFailover()
        rid, router, relayed = await _relayed_with(nc, failover)

        def delta(seq, text="", ids=(), attempt=0, **kw):
            return encode(TokenDelta(rid, text=text, num_tokens=len(ids), seq=seq, token_ids=list(ids) or None,
                                     attempt=attempt, worker_id="w1", **kw))

        end = ErrorInfo("ended", code=code, status=status)
        for data in [delta(0), delta(1, "ab", [7, 8]), delta(3, "lost-before", [9]),  # seq 2 never came
                     delta(0, attempt=1), delta(1, "c", [11], attempt=1),
                     delta(2, attempt=1, error=end, is_last=True)]:
            await nc.publish(router.subject, _routed(rid, data))
        await nats_client.settled(nc)
        await relayed.first()
        got = [d async for d in relayed.deltas()]
        assert "".join(d.text for d in got) == "abc" and got[-1].error is not None
        assert got[-1].error.code == told
        assert relayed.handed_off is (code == "stream_taken_over") and relayed.is_finished
        assert failover.billed == billed
        if billed:
            assert got[-1].usage is not None and got[-1].usage.completion_tokens == billed[0]
        await relayed.close()
    finally:
        await nc.close()


async def test_the_next_delta_waits_only_when_none_is_here_and_the_request_has_not_finished(nats_url):
    """What a stream asks before writing what it holds (gateway/serving.py): deltas that arrived together are
    written together, the last with the stream's end, and a lone one at once."""
    nc = await nats.connect(nats_url)
    try:
        request = GenerateRequest(uuid.uuid4().hex, "m", "pro", SamplingParams(max_tokens=9), created_at=time.time(),
                                  deadline_at=time.time() + 30, prompt="x")
        router = TokenRouter(nc)
        await router.start()
        relayed = RelayedRequest(nc, request, router.open(request.request_id), stall_timeout_s=10, retry_after_s=1)
        rid = request.request_id
        together = [RoutedDelta(rid, msgspec.Raw(_delta(rid, seq, text))) for seq, text in enumerate(["", "a", "b"])]
        await nc.publish(router.subject, encode(together))  # one step's message: routed to the inbox at once
        assert (await relayed.first()).seq == 0 and not relayed.next_delta_waits  # "a" and "b" are here
        deltas = relayed.deltas()
        assert (await anext(deltas)).text == "a" and not relayed.next_delta_waits  # "b" is
        assert (await anext(deltas)).text == "b" and relayed.next_delta_waits  # nothing is, and more will come
        last = TokenDelta(rid, text="c", num_tokens=1, seq=3, finish_reason="stop", is_last=True)
        await nc.publish(router.subject, _routed(rid, encode(last)))
        assert (await anext(deltas)).text == "c" and not relayed.next_delta_waits  # finished: nothing more comes
        await deltas.aclose()
        await relayed.close()
    finally:
        await nc.close()
