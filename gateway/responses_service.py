"""``POST /v1/responses``: a response is a chat turn on the worker. Its messages (instructions, the earlier turns of
its ``previous_response_id`` chain or its ``conversation``, the new input items) go out as a chat request through
the same admission, queues, relay and billing as chat (gateway/serving.py's ``start``/``deltas``/``end``), and come
back as a response object, a stream of semantic events, or a stored background response.

    context(body) ─▶ [admitted by the route] ─▶ create ─┬─ body:       deltas ─▶ BodyBuilder ─▶ response object
                                                        ├─ stream:     deltas ─▶ ResponseEvents ─▶ SSE
                                                        └─ background: queued row; a task runs it, storing
                                                                       in_progress, then how it ended
    every ending ─▶ settle the ticket ─▶ store (store=true) ─▶ the conversation gets the input and the reply
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse
from nats.aio.client import Client as NATS

from switchyard.domain.admission.ticket import Ticket
from switchyard.domain.api.response_items import output_items, to_messages
from switchyard.domain.api.response_object import response_json, status_of
from switchyard.domain.api.responses import ResponseCreate
from switchyard.domain.api.shapes import CHAT
from switchyard.domain.conversations import Conversations
from switchyard.domain.errors import OpenAIError
from switchyard.domain.responses import ALIVE_EVERY_S, Responses
from switchyard.gateway.completion_shapes import BodyBuilder, Shape
from switchyard.gateway.drain import InFlightCounter
from switchyard.gateway.response_events import ResponseEvents
from switchyard.gateway.serving import CompletionService, Outcome, admitted_service
from switchyard.shared import subjects
from switchyard.shared.config import RequestLimits
from switchyard.shared.messages import ChatMessage, ErrorInfo, GenerateRequest, StoredResponse

log = logging.getLogger("switchyard.gateway")

GATEWAY_ERROR = ErrorInfo("The gateway had an error running the response.", code="server_error",
                          type="server_error", status=500)
CLIENT_GONE = ErrorInfo("The client went away before the response ended.", code="cancelled", status=499)


@dataclass(slots=True)
class Context:
    """What a request brings from the server: the earlier messages, and the model that answered them."""

    history: list[ChatMessage] = field(default_factory=list)
    model: str | None = None

    def num_chars(self) -> int:
        return sum(len(m.content) + sum(len(c.arguments) for c in m.tool_calls or ()) for m in self.history)


@dataclass(slots=True)
class _Run:
    """One response on its way: its request, its object's fixed part, and where it is stored."""

    body: ResponseCreate
    ticket: Ticket
    request: GenerateRequest
    response_id: str

    def json(self, status: str, outcome: Outcome | None = None, output: list[dict] | None = None,
             error: ErrorInfo | None = None, incomplete: dict | None = None) -> dict:
        return response_json(self.response_id, self.request.created_at, self.request.model, self.body.echo(), status,
                             output, None if outcome is None else outcome.usage, error, incomplete,
                             admitted_service(self.ticket).label)

    def record(self, response: dict, outcome: Outcome | None = None) -> StoredResponse:
        """``response`` as stored; once it ended well, with what its conversation gets."""
        messages = []
        if outcome is not None and response["status"] in ("completed", "incomplete"):
            messages = to_messages(self.body.items) + [
                ChatMessage("assistant", outcome.text, tool_calls=outcome.tool_calls or None)]
        return StoredResponse(self.response_id, self.ticket.auth.tenant_id, self.request.request_id,
                              response["status"], json.dumps(response), json.dumps(self.body.items),
                              self.body.background, self.body.previous_response_id, self.body.conversation_id,
                              messages)


class ResponseService:
    def __init__(self, completions: CompletionService, responses: Responses, conversations: Conversations,
                 in_flight: InFlightCounter, nc: NATS, limits: RequestLimits) -> None:
        """``in_flight``: background responses count as open requests, so a draining gateway finishes them.
        ``nc``: cancels reach a background response's worker through it. ``limits``: how much of a conversation's
        history is loaded (as for a conversation turn)."""
        self._nc = nc
        self._limits = limits
        self._completions = completions
        self._responses = responses
        self._conversations = conversations
        self._in_flight = in_flight
        self._background: set[asyncio.Task] = set()

    async def context(self, body: ResponseCreate, tenant_id: str) -> Context:
        """The earlier turns ``body`` continues (its previous response's chain, or its conversation); 404 for
        another tenant's."""
        if body.previous_response_id is not None:
            history, model = await self._responses.history(body.previous_response_id, tenant_id)
            return Context(history, model)
        if body.conversation_id is not None:
            conversation = await self._conversations.owned(body.conversation_id, tenant_id)
            history, _ = await self._conversations.history(conversation, self._limits.max_history_messages,
                                                           self._limits.max_history_chars)
            return Context(history, conversation["model"])
        return Context()

    async def create(self, body: ResponseCreate, ticket: Ticket, context: Context):
        """Answer an admitted ``body``: the response object, its event stream, or (background) its queued
        object."""
        instructions = [ChatMessage("system", body.instructions)] if body.instructions else []
        request = await self._completions.wire_request(
            body, ticket, messages=instructions + context.history + to_messages(body.items),
            sampling=body.sampling(), response_format=body.response_format(), tool_use=body.tool_use(),
            truncate_history=body.truncation == "auto")
        run = _Run(body, ticket, request, f"resp_{request.request_id}")
        if body.background:
            queued = run.json("queued")
            await self._responses.save(run.record(queued), hold=False)  # to be polled, it must be stored now
            task = asyncio.create_task(self._run_background(run))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return JSONResponse(queued, headers={"X-Request-Id": request.request_id})
        relayed, first = await self._completions.start(request, ticket)
        if body.stream:
            return StreamingResponse(self._stream(run, relayed, first), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request.request_id})
        outcome, error = await self._collect(run, relayed, first)
        response = self._final(run, outcome, error)
        if error is not None:
            raise OpenAIError.from_info(error)
        return JSONResponse(response, headers={"X-Request-Id": request.request_id})

    async def _collect(self, run: _Run, relayed, first) -> tuple[Outcome, ErrorInfo | None]:
        """Every delta of a response not streamed, gathered; it ends (settled, stored) however it went."""
        outcome = Outcome(request_id=run.request.request_id)
        error: ErrorInfo | None = CLIENT_GONE
        builder = BodyBuilder(Shape(CHAT), run.request, logprobs=False)
        try:
            async for delta in self._completions.deltas(relayed, first):
                builder.add(delta)  # an error's too: its usage is what the worker ran before it failed
                if delta.error is not None:
                    error = delta.error
                    break
            else:
                error = None
            outcome.take(builder)
        finally:
            await self._completions.end(relayed, run.ticket, outcome, outcome.usage.total_tokens,
                                        self._store_when_done(run, lambda: error))
        return outcome, error

    def _final(self, run: _Run, outcome: Outcome, error: ErrorInfo | None) -> dict:
        """The response object of a reply that ended (``error``: how it failed)."""
        if error is not None:
            status = "cancelled" if error.code == "cancelled" else "failed"
            return run.json(status, outcome, output_items(run.request.request_id, outcome.text, outcome.tool_calls,
                                                          "incomplete"), None if status == "cancelled" else error)
        status, incomplete = status_of(outcome.finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        return run.json(status, outcome, output_items(run.request.request_id, outcome.text, outcome.tool_calls,
                                                      item_status), incomplete=incomplete)

    def _store_when_done(self, run: _Run, error_of, response_of=None):
        """The ``on_finish`` of a response: stores its final object (store=true), once it is known."""

        async def store(outcome: Outcome) -> None:
            if not run.body.store:
                return
            response = response_of(outcome) if response_of is not None else self._final(run, outcome, error_of())
            try:
                await self._responses.save(run.record(response, outcome))
            except Exception:  # Postgres away and JetStream too: the client has its answer; say what was lost
                log.exception("could not store response %s", run.response_id)

        return store

    async def _stream(self, run: _Run, relayed, first):
        events = ResponseEvents(run.request.request_id)
        outcome = Outcome(request_id=run.request.request_id)
        reply = BodyBuilder(Shape(CHAT), run.request, logprobs=False)
        final: dict | None = None  # the response the stream ended with
        broken: dict | None = None  # the gateway failed before its end (its tokens unknown here: the worker bills)

        def response_of(_: Outcome) -> dict:  # what the stream ended with; a client gone: cancelled
            return final or broken or run.json("cancelled", outcome, events.items)

        # Events already here are written together, one send (one socket write) instead of one each, as chat
        # chunks are (gateway/serving.py): the opening's, a delta's and those of deltas that arrived together, and
        # the last delta's with the closing events and the terminal one.
        ready: list[bytes] = []
        try:
            yield b"".join(events.opening(run.json("in_progress")))
            error = None
            async for delta in self._completions.deltas(relayed, first):
                reply.add(delta)  # an error's too: its usage is what the worker ran before it failed
                if delta.error is not None:
                    error = delta.error
                    break
                ready += events.delta(delta)
                if ready and relayed.next_delta_waits:
                    yield b"".join(ready)
                    ready.clear()
            outcome.take(reply)
            status, incomplete = status_of(outcome.finish_reason) if error is None else ("failed", None)
            ready += events.close("completed" if status == "completed" else "incomplete")
            final = run.json(status, outcome, events.items, error, incomplete)
            ready.append(events.terminal(final))
            yield b"".join(ready)
        except Exception:  # the gateway's own fault mid-stream: an error event ends it, not a cut connection
            log.exception("response %s failed in the gateway", run.response_id)
            broken = run.json("failed", outcome, events.items, GATEWAY_ERROR)
            yield b"".join([*ready, events.error(GATEWAY_ERROR)])
        finally:
            outcome.take(reply)
            await self._completions.end(relayed, run.ticket, outcome,
                                        outcome.usage.total_tokens if final is not None else None,
                                        self._store_when_done(run, None, response_of))

    async def _run_background(self, run: _Run) -> None:
        """A background response, start to end, stored at each step; counted as an open request, and its row
        touched while it runs (housekeeping fails the ones a crashed gateway left)."""
        await self._in_flight.add(1)
        alive = asyncio.create_task(self._keep_alive(run.response_id, run.request.request_id))
        try:
            try:
                relayed, first = await self._completions.start(run.request, run.ticket)
            except OpenAIError as exc:
                await self._responses.save(run.record(run.json("failed", error=exc.info())))
                return
            await self._responses.save(run.record(run.json("in_progress")))
            await self._collect(run, relayed, first)
        except Exception:
            log.exception("background response %s failed", run.response_id)
            await self._responses.save(run.record(run.json("failed", error=GATEWAY_ERROR)))
        finally:
            alive.cancel()
            await self._in_flight.add(-1)

    async def _keep_alive(self, response_id: str, request_id: str) -> None:
        while True:
            await asyncio.sleep(ALIVE_EVERY_S)
            try:
                open_ = await self._responses.touch(response_id)
            except Exception as exc:  # Postgres away: housekeeping, on the same Postgres, is waiting too
                log.warning("could not mark background response %s alive: %r", response_id, exc)
                continue
            if not open_:  # failed by housekeeping while this gateway stalled: nobody will read what it makes
                log.warning("background response %s was closed while running: stopping it", response_id)
                if self._nc.is_connected:
                    await self._nc.publish(subjects.cancel_subject(request_id), b"")
                return

    async def cancel(self, response_id: str, tenant_id: str) -> dict:
        """Cancel a background response: marked cancelled (whichever gateway runs it), its worker told to stop."""
        response, request_id = await self._responses.cancel(response_id, tenant_id)
        if request_id is not None and self._nc.is_connected:
            await self._nc.publish(subjects.cancel_subject(request_id), b"")
        return response
