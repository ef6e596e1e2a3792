"""A second copy of a request a worker already holds (workers/service/intake.py): acked and dropped, the held one
going on. When the held one is an offer and the copy is the one the gateway queued for every worker after the offer
went unanswered, the held one stops being an offer: past the offer's time it would otherwise be dropped before its
step as given to others, and with the copy gone too the request would run nowhere."""

from __future__ import annotations

import time

import msgspec

from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams, encode
from switchyard.workers.service.held import HeldRequests, Tracked
from switchyard.workers.service.intake import Intake, offer_expired


class StubConnection:
    def new_inbox(self) -> str:
        return "_INBOX.test"


class Message:
    """A JetStream message as the intake sees one: its data, and whether it was acked."""

    def __init__(self, request: GenerateRequest) -> None:
        self.data, self.headers, self.subject, self.acked = encode(request), None, "llm.req.m.pro", False

    async def ack(self) -> None:
        self.acked = True


def _request(offer_s: float | None = None) -> GenerateRequest:
    now = time.time()
    request = GenerateRequest("r", "m", "pro", SamplingParams(max_tokens=1), now, now + 60,
                              messages=[ChatMessage(role="user", content="hi")], tenant_id="t")
    return request if offer_s is None else msgspec.structs.replace(request, affinity_until=now + offer_s)


async def _receive_beside(held_request: GenerateRequest, copy: GenerateRequest) -> tuple[Tracked, Message, int]:
    held = HeldRequests()
    tracked = Tracked(held_request, received_at=time.time())
    held.preparing["r"] = tracked  # being prepared when the copy comes
    intake = Intake(None, StubConnection(), None, "m", "w", held=held, capacity=None, out=None)
    try:
        msg = Message(copy)
        took = await intake._receive(msg)
    finally:
        intake.shutdown()
    return tracked, msg, took


async def test_the_queued_copy_of_an_offer_held_here_makes_the_held_one_run_whatever_the_offers_time():
    tracked, msg, took = await _receive_beside(_request(offer_s=-1.0), _request())  # the offer's time is over
    assert msg.acked and took == 0  # the copy is dropped...
    assert not offer_expired(tracked.request)  # ...and the held one is no longer an offer that may expire


async def test_a_redelivered_copy_leaves_the_held_request_as_it_was():
    offer = _request(offer_s=-1.0)
    tracked, msg, took = await _receive_beside(offer, offer)  # the offer delivered again: still an offer
    assert msg.acked and took == 0 and offer_expired(tracked.request)
    plain = _request()
    tracked, msg, took = await _receive_beside(plain, plain)
    assert msg.acked and took == 0 and tracked.request is plain
