"""One response on its way (``ResponseRun``: its request, its object as it began, how it is stored) and a streamed
one's events as its deltas come (``ResponseStream``); no I/O (gateway/responses_service.py does it).

A run starts in two ways: from a ``POST /v1/responses`` body on the gateway that admitted it, or from its stored
row on a gateway that takes its stream over (GET /v1/responses/{id}?stream=true&starting_after=N after the first
gateway died). Every later state of the response repeats what the object said as it began (its id, model, creation
time, settings), so both make the same objects and the same events.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from switchyard.domain.admission.ticket import Ticket
from switchyard.domain.api.response_items import to_messages
from switchyard.domain.api.response_object import in_state, response_json, status_of
from switchyard.domain.api.responses import ResponseCreate
from switchyard.domain.api.shapes import CHAT
from switchyard.gateway.completion_shapes import BodyBuilder, Shape
from switchyard.gateway.response_events import ResponseEvents
from switchyard.gateway.serving import Outcome, admitted_service
from switchyard.shared.messages import ChatMessage, ErrorInfo, GenerateRequest, StoredResponse, TokenDelta


@dataclass(slots=True)
class ResponseRun:
    """One response on its way. ``ticket`` None: a stream taken over from a gateway that died (that one held the
    admission's ticket)."""

    request: GenerateRequest
    response_id: str
    tenant_id: str
    began: dict[str, Any]  # the object as it began; later states change its status, output, usage, error
    items: list[dict[str, Any]]  # the request's input items
    store: bool
    background: bool
    previous_response_id: str | None
    conversation_id: str | None
    ticket: Ticket | None = None

    @classmethod
    def new(cls, body: ResponseCreate, ticket: Ticket, request: GenerateRequest) -> ResponseRun:
        response_id = f"resp_{request.request_id}"
        began = response_json(response_id, request.created_at, request.model, body.echo(), "in_progress",
                              service_tier=admitted_service(ticket).label)
        return cls(request, response_id, ticket.auth.tenant_id, began, body.items, body.store, body.background,
                   body.previous_response_id, body.conversation_id, ticket)

    @classmethod
    def resumed(cls, stored: StoredResponse, request: GenerateRequest) -> ResponseRun:
        """The run of a stored response whose stream another gateway takes over (``request``: as its worker runs
        it)."""
        return cls(request, stored.response_id, stored.tenant_id, json.loads(stored.body),
                   json.loads(stored.input_items), True, stored.background, stored.previous_response_id,
                   stored.conversation_id)

    def json(self, status: str, outcome: Outcome | None = None, output: list[dict] | None = None,
             error: ErrorInfo | None = None, incomplete: dict | None = None) -> dict:
        return in_state(self.began, status, output, None if outcome is None else outcome.usage, error, incomplete)

    def record(self, response: dict, outcome: Outcome | None = None) -> StoredResponse:
        """``response`` as stored; once it ended well, with what its conversation gets."""
        messages = []
        if outcome is not None and response["status"] in ("completed", "incomplete"):
            messages = to_messages(self.items) + [
                ChatMessage("assistant", outcome.text, tool_calls=outcome.tool_calls or None)]
        return StoredResponse(self.response_id, self.tenant_id, self.request.request_id, response["status"],
                              json.dumps(response), json.dumps(self.items), self.background,
                              self.previous_response_id, self.conversation_id, messages)


class ResponseStream:
    """A streamed response's events, made from its deltas in order (``after``: those up to this sequence number
    are left out, a resuming client has them). ``final``: the object it ended with, once it did."""

    def __init__(self, run: ResponseRun, after: int = -1) -> None:
        self.run = run
        self.events = ResponseEvents(run.request.request_id, after)
        self.outcome = Outcome(request_id=run.request.request_id)
        self._reply = BodyBuilder(Shape(CHAT), run.request, logprobs=False)
        self.error: ErrorInfo | None = None
        self.final: dict | None = None

    def opening(self) -> list[bytes]:
        return self.events.opening(self.run.json("in_progress"))

    def add(self, delta: TokenDelta) -> list[bytes]:
        """The events of one delta; an error's ends the stream (``end`` makes its closing events)."""
        self._reply.add(delta)  # an error's too: its usage is what the worker ran before it failed
        if delta.error is not None:
            self.error = delta.error
            return []
        return self.events.delta(delta)

    def end(self) -> list[bytes]:
        """The closing events and the terminal one, with the whole response (``final``)."""
        self.outcome.take(self._reply)
        status, incomplete = status_of(self.outcome.finish_reason) if self.error is None else ("failed", None)
        out = self.events.close("completed" if status == "completed" else "incomplete")
        self.final = self.run.json(status, self.outcome, self.events.items, self.error, incomplete)
        out.append(self.events.terminal(self.final))
        return out

    def settled(self) -> Outcome:
        """What ran, however the stream stopped."""
        self.outcome.take(self._reply)
        return self.outcome

    def cancelled(self) -> dict:
        """The object of a stream whose client went away before its end."""
        return self.run.json("cancelled", self.outcome, self.events.items)
