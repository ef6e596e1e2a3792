"""How a streamed response ends when something fails mid-way, without servers: ``ResponseService``'s stream over
``RelayDouble``, a named test double of CompletionService's deltas/end (the real relay is tested end to end in
tests/e2e/test_responses.py, where no failure can be made to happen mid-stream on demand). A worker's error ends
the stream with ``response.failed`` carrying it; a fault of the gateway's own with an ``error`` event; both are
stored failed, and only a stream that ended tells the ticket its tokens."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from switchyard.domain.api.responses import ResponseCreate
from switchyard.gateway.response_run import ResponseRun, ResponseStream
from switchyard.gateway.responses_service import ResponseService
from switchyard.shared.config import RequestLimits
from switchyard.shared.messages import STREAM_TAKEN_OVER, ErrorInfo, GenerateRequest, SamplingParams, TokenDelta, Usage

LOST = ErrorInfo("The worker running the request stopped; please retry.", code="worker_lost", type="server_error",
                 status=503)


class RelayDouble:
    """Test double: yields the first delta and then ``later`` (an exception in it is raised there), the relayed
    request handed off once a worker's notice that another gateway took the stream over comes (as its state machine
    says, gateway/relay_state.py); ``end`` records the tokens it was told and stores the response as the real one
    does (its ``on_finish``)."""

    def __init__(self, later: list) -> None:
        self.later = later
        self.used_tokens: int | None | str = "never ended"

    async def deltas(self, relayed, first: TokenDelta):
        yield first
        for item in self.later:
            await asyncio.sleep(0)  # as a delta's arrival does, lets other tasks run (storing the response begun)
            if isinstance(item, Exception):
                raise item
            relayed.next_delta_waits = item.usage is None  # the request's last delta carries its usage
            relayed.handed_off = item.error is not None and item.error.code == STREAM_TAKEN_OVER
            yield item

    async def end(self, relayed, ticket, outcome, used_tokens, on_finish=None) -> None:
        self.used_tokens = used_tokens
        await on_finish(outcome)


class StoreDouble:
    def __init__(self) -> None:
        self.saved = []
        self.touched = 0

    async def save(self, record, hold: bool = True) -> None:
        self.saved.append(record)

    async def touch(self, response_id: str) -> bool:
        self.touched += 1
        return True


async def stream(later: list, sends: list | None = None,
                 resumed: bool = False) -> tuple[list[dict], RelayDouble, StoreDouble]:
    """The events a client reads; ``sends``, when given, gets each send's event types (one send: one write).
    ``resumed``: the stream taken over from the row its first gateway stored (which holds the ticket)."""
    relay, store = RelayDouble(later), StoreDouble()
    service = ResponseService(relay, store, conversations=None, in_flight=None, nc=None, limits=RequestLimits())
    request = GenerateRequest("r1", "tiny", "pro", SamplingParams(), 0.0, 0.0)
    ticket = SimpleNamespace(service=SimpleNamespace(label="default"), auth=SimpleNamespace(tenant_id="t1"))
    run = ResponseRun.new(ResponseCreate(model="tiny", input="hi", stream=True), ticket, request)
    if resumed:
        run = ResponseRun.resumed(run.record(run.json("in_progress")), request)
    response = ResponseStream(run)
    relayed = SimpleNamespace(next_delta_waits=True, handed_off=False)  # each delta alone, written at once
    chunks = []
    async for chunk in service._stream(response, relayed, relay.deltas(relayed, TokenDelta("r1")),
                                       response.opening()):
        chunks.append(chunk)
    if not resumed:
        # Stored as it began (another gateway may resume it from the row), then as it ended.
        assert [r.status for r in store.saved[:1]] == ["in_progress"]
        store.saved = store.saved[1:]
    if sends is not None:
        sends += [[json.loads(line[6:])["type"] for line in chunk.decode().splitlines() if line.startswith("data: ")]
                  for chunk in chunks]
    events = [json.loads(line[6:]) for chunk in chunks for line in chunk.decode().splitlines()
              if line.startswith("data: ")]
    return events, relay, store


def said(events: list[dict]) -> str:
    return "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")


async def test_a_worker_error_mid_stream_ends_it_with_response_failed_carrying_the_error():
    events, relay, store = await stream([TokenDelta("r1", text="Hel", num_tokens=1),
                                         TokenDelta("r1", error=LOST, finish_reason="error",
                                                    usage=Usage(prompt_tokens=3, completion_tokens=1))])
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert said(events) == "Hel" and events[-1]["type"] == "response.failed"
    failed = events[-1]["response"]
    assert failed["status"] == "failed" and failed["error"]["code"] == "worker_lost"
    assert failed["output"][0]["content"][0]["text"] == "Hel"  # what was streamed, closed as incomplete
    (record,) = store.saved
    # a failed reply adds nothing to a conversation
    assert record.status == "failed" and record.conversation_messages == []
    assert relay.used_tokens == 4  # what the worker's last word says it ran


async def test_a_gateway_fault_mid_stream_ends_it_with_an_error_event():
    events, relay, store = await stream([TokenDelta("r1", text="Hel", num_tokens=1), RuntimeError("bug")])
    assert said(events) == "Hel"
    assert events[-1] == {"type": "error", "sequence_number": len(events) - 1, "code": "server_error",
                          "message": "The gateway had an error running the response.", "param": None}
    (record,) = store.saved
    assert record.status == "failed" and json.loads(record.body)["error"]["code"] == "server_error"
    assert relay.used_tokens is None  # unknown here: the worker bills what it ran


@pytest.mark.parametrize("reason, last", [("stop", "response.completed"), ("length", "response.incomplete")])
async def test_a_stream_that_ends_well_is_stored_as_it_ended(reason, last):
    events, relay, store = await stream([TokenDelta("r1", text="Hi", num_tokens=1, finish_reason=reason,
                                                    usage=Usage(prompt_tokens=3, completion_tokens=1))])
    assert events[-1]["type"] == last and events[-1]["response"]["usage"]["total_tokens"] == 4
    assert relay.used_tokens == 4 and [r.status for r in store.saved] == [events[-1]["response"]["status"]]


async def test_a_response_is_written_in_few_sends_its_opening_each_lone_delta_and_its_end():
    sends = []
    events, _, _ = await stream([TokenDelta("r1", text="Hel", num_tokens=1),
                                 TokenDelta("r1", text="lo", num_tokens=1, finish_reason="stop",
                                            usage=Usage(prompt_tokens=3, completion_tokens=2))], sends)
    assert said(events) == "Hello"
    opening, hel, end = sends  # the last delta's events go with the closing ones, one write
    assert opening[0] == "response.created" and "response.output_text.delta" not in opening
    assert hel == ["response.output_item.added", "response.content_part.added", "response.output_text.delta"]
    assert end[0] == "response.output_text.delta" and end[-1] == "response.completed"


async def test_a_stream_another_gateway_took_over_is_left_to_it_neither_stored_as_ended_nor_billed_here():
    taken = ErrorInfo("taken over", code="stream_taken_over", status=409)
    events, relay, store = await stream([TokenDelta("r1", text="Hel", num_tokens=1),
                                         TokenDelta("r1", error=taken, is_last=True)])
    assert said(events) == "Hel"
    assert store.saved == []  # only the row as it began: the other gateway stores how it ends
    assert relay.used_tokens is None  # its worker bills it when it ends


async def test_a_stream_taken_over_only_touches_the_row_its_first_gateway_stored_then_stores_how_it_ended():
    events, relay, store = await stream([TokenDelta("r1", text="Hel", num_tokens=1),
                                         TokenDelta("r1", text="l", num_tokens=1),
                                         TokenDelta("r1", text="o", num_tokens=1, finish_reason="stop",
                                                    usage=Usage(prompt_tokens=3, completion_tokens=3))],
                                        resumed=True)
    assert said(events) == "Hello" and events[-1]["type"] == "response.completed"
    assert [r.status for r in store.saved] == ["completed"]  # not rewritten in_progress: the row is the first run's
    assert store.touched == 1  # at once: its first gateway's last touch may be long past
    assert relay.used_tokens == 6
