"""``POST /v1/responses``: a response is a chat turn on the worker. Its messages (instructions, the earlier turns of
its ``previous_response_id`` chain or its ``conversation``, the new input items) go out as a chat request through
the same admission, queues, relay and billing as chat (gateway/serving.py's ``start``/``deltas``/``end``), and come
back as a response object, a stream of semantic events, or a stored background response.

    context(body) ─▶ [admitted by the route] ─▶ create ─┬─ body:       deltas ─▶ BodyBuilder ─▶ response object
                                                        ├─ stream:     deltas ─▶ ResponseStream ─▶ SSE; stored
                                                        │              in_progress as it starts (store=true)
                                                        └─ background: queued row; a task runs it, storing
                                                                       in_progress, then how it ended
    every ending ─▶ settle the ticket ─▶ store (store=true) ─▶ the conversation gets the input and the reply

    GET ?stream=true&starting_after=N ─▶ resume: the stored row's request taken over from its worker (its gateway
                                         died), its events made again from the run's first delta, those after N sent;
                                         a background one is run on from here (its first gateway lets go)
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse
from nats.aio.client import Client as NATS

from switchyard.domain.admission.ticket import Ticket
from switchyard.domain.api.response_items import output_items, to_messages
from switchyard.domain.api.response_object import status_of
from switchyard.domain.api.responses import ResponseCreate
from switchyard.domain.api.shapes import CHAT
from switchyard.domain.conversations import Conversations
from switchyard.domain.errors import OpenAIError
from switchyard.domain.responses import ALIVE_EVERY_S, Responses
from switchyard.gateway.completion_shapes import BodyBuilder, Shape
from switchyard.gateway.drain import InFlightCounter
from switchyard.gateway.response_resume import expired, take_over
from switchyard.gateway.response_run import ResponseRun, ResponseStream
from switchyard.gateway.serving import CompletionService, Outcome
from switchyard.gateway.stream_resume import StreamResumer
from switchyard.shared import subjects
from switchyard.shared.config import RequestLimits
from switchyard.shared.messages import ChatMessage, ErrorInfo, TokenDelta

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


class ResponseService:
    def __init__(self, completions: CompletionService, responses: Responses, conversations: Conversations,
                 in_flight: InFlightCounter, nc: NATS, limits: RequestLimits,
                 resumer: StreamResumer | None = None) -> None:
        """``in_flight``: background responses count as open requests, so a draining gateway finishes them.
        ``nc``: cancels reach a background response's worker through it. ``limits``: how much of a conversation's
        history is loaded (as for a conversation turn). ``resumer``: takes over streams whose gateway died (None:
        this gateway resumes none)."""
        self._nc = nc
        self._resumer = resumer
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
            truncate_history=body.truncation == "auto",
            # A stored response may be streamed from another gateway: a background one too (it moves there).
            resumable_s=self._completions.resumable_s((body.stream or body.background) and body.store
                                                      and self._resumer is not None))
        run = ResponseRun.new(body, ticket, request)
        if body.background:
            queued = run.json("queued")
            await self._responses.save(run.record(queued), hold=False)  # to be polled, it must be stored now
            task = asyncio.create_task(self._run_background(run, ticket))
            self._background.add(task)
            task.add_done_callback(self._background.discard)
            return JSONResponse(queued, headers={"X-Request-Id": request.request_id})
        relayed, first = await self._completions.start(request, ticket)
        if body.stream:
            stream = ResponseStream(run)
            return StreamingResponse(self._stream(stream, relayed, self._completions.deltas(relayed, first),
                                                  stream.opening()),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Request-Id": request.request_id})
        outcome, error = await self._collect(run, relayed, first)
        response = self._final(run, outcome, error)
        if error is not None:
            raise OpenAIError.from_info(error)
        return JSONResponse(response, headers={"X-Request-Id": request.request_id})

    async def _collect(self, run: ResponseRun, relayed, first) -> tuple[Outcome, ErrorInfo | None]:
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
            if relayed.handed_off:
                # A client streams it from another gateway now, which runs it to its end and stores that.
                await self._completions.end(relayed, run.ticket, outcome, None)
            else:
                await self._completions.end(relayed, run.ticket, outcome, outcome.usage.total_tokens,
                                            self._store_when_done(run, lambda: error))
        return outcome, error

    def _final(self, run: ResponseRun, outcome: Outcome, error: ErrorInfo | None) -> dict:
        """The response object of a reply that ended (``error``: how it failed)."""
        if error is not None:
            status = "cancelled" if error.code == "cancelled" else "failed"
            return run.json(status, outcome, output_items(run.request.request_id, outcome.text, outcome.tool_calls,
                                                          "incomplete"), None if status == "cancelled" else error)
        status, incomplete = status_of(outcome.finish_reason)
        item_status = "completed" if status == "completed" else "incomplete"
        return run.json(status, outcome, output_items(run.request.request_id, outcome.text, outcome.tool_calls,
                                                      item_status), incomplete=incomplete)

    def _store_when_done(self, run: ResponseRun, error_of, response_of=None):
        """The ``on_finish`` of a response: stores its final object (store=true), once it is known."""

        async def store(outcome: Outcome) -> None:
            if not run.store:
                return
            response = response_of(outcome) if response_of is not None else self._final(run, outcome, error_of())
            if response is None:
                return
            try:
                await self._responses.save(run.record(response, outcome))
            except Exception:  # Postgres away and JetStream too: the client has its answer; say what was lost
                log.exception("could not store response %s", run.response_id)

        return store

    async def _stream(self, stream: ResponseStream, relayed, deltas: AsyncIterator[TokenDelta],
                      ready: list[bytes]):
        """The SSE body of a streamed response: ``ready`` (events made already: its opening, or what a resuming
        client had not), then those of ``deltas``. A stored one is kept touched while it runs and stored as it
        ended (a client gone: cancelled)."""
        run = stream.run
        broken: dict | None = None  # the gateway failed before its end (its tokens unknown here: the worker bills)

        def response_of(_: Outcome) -> dict | None:
            if relayed.handed_off:
                return None  # another gateway goes on with it, and stores how it ends
            return stream.final or broken or stream.cancelled()

        # Held for another gateway to resume the stream from, if this one dies (and touched meanwhile, so that
        # housekeeping fails it only once no gateway runs it). The row is the run's that admitted it (its ticket):
        # a stream taken over only touches it, at once (its first gateway's last touch may be long past).
        owner = run.ticket is not None
        alive = asyncio.create_task(self._keep_alive(run, save=owner, touch_now=not owner)) if run.store else None
        # Events already here are written together, one send (one socket write) instead of one each, as chat
        # chunks are (gateway/serving.py): the opening's, a delta's and those of deltas that arrived together, and
        # the last delta's with the closing events and the terminal one.
        try:
            if any(ready):  # the opening goes out at once, before the first token
                yield b"".join(ready)
                ready.clear()
            if stream.final is None:  # a resumed stream may have ended in what its worker sent again
                async for delta in deltas:
                    ready += stream.add(delta)
                    if stream.error is not None:
                        break
                    if relayed.next_delta_waits and any(ready):
                        yield b"".join(ready)
                        ready.clear()
                ready += stream.end()
            if ready:
                yield b"".join(ready)
        except Exception:  # the gateway's own fault mid-stream: an error event ends it, not a cut connection
            log.exception("response %s failed in the gateway", run.response_id)
            broken = run.json("failed", stream.outcome, stream.events.items, GATEWAY_ERROR)
            yield b"".join([*ready, stream.events.error(GATEWAY_ERROR)])
        finally:
            if alive is not None:
                alive.cancel()
            outcome = stream.settled()
            ended_here = stream.final is not None and not relayed.handed_off  # else its worker's bill says
            await self._completions.end(relayed, run.ticket, outcome,
                                        outcome.usage.total_tokens if ended_here else None,
                                        self._store_when_done(run, None, response_of))

    async def resume(self, response_id: str, tenant_id: str, starting_after: int | None):
        """``GET /v1/responses/{id}?stream=true&starting_after=N``: the stream of a stored response whose gateway
        died, taken over from its worker and made again from its first delta; only the events after N are sent.
        404: not the caller's, or N names an event never sent; 410: it ended, or can no longer be resumed."""
        if self._resumer is None:
            raise OpenAIError(400, "This gateway does not resume streams (stream_resume_window_s is 0).",
                              code="unsupported_parameter", param="stream")
        stored = await self._responses.stored(response_id, tenant_id)
        if stored.background and stored.status == "queued":
            raise OpenAIError(400, "This background response has not started yet: ask for its stream once it is "
                              "in_progress.", code="invalid_request", param="stream")
        if stored.status not in ("queued", "in_progress"):
            raise expired(f"This response has ended ({stored.status}); GET it without stream=true for the whole "
                          "response.")
        taken = await take_over(self._resumer, self._completions, stored, starting_after)
        run_on = self._adopt if stored.background else self._stream
        body = run_on(taken.stream, taken.relayed, taken.deltas, taken.ready)
        return StreamingResponse(body, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Request-Id": stored.request_id})

    async def _adopt(self, stream: ResponseStream, relayed, deltas: AsyncIterator[TokenDelta], ready: list[bytes]):
        """A background response's stream, taken over: this gateway runs it from now on (the one that ran it let
        go), to its end and stored, whether or not the client stays to read it (counted as an open request)."""
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()
        listening = True

        async def run() -> None:
            await self._in_flight.add(1)
            try:
                async for chunk in self._stream(stream, relayed, deltas, ready):
                    if listening:
                        chunks.put_nowait(chunk)
            finally:
                chunks.put_nowait(None)
                await self._in_flight.add(-1)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        try:
            while (chunk := await chunks.get()) is not None:
                yield chunk
        finally:
            listening = False

    async def _run_background(self, run: ResponseRun, ticket: Ticket) -> None:
        """A background response, start to end, stored at each step; counted as an open request, and its row
        touched while it runs (housekeeping fails the ones a crashed gateway left)."""
        await self._in_flight.add(1)
        alive = asyncio.create_task(self._keep_alive(run))
        try:
            try:
                # Its client was told "queued": NATS restarting delays it, as a full queue would, and fails it
                # only past the gateway's queue timeout.
                relayed, first = await self._completions.start(run.request, ticket,
                                                               queue_wait_s=self._completions.queue_timeout_s)
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

    async def _keep_alive(self, run: ResponseRun, save: bool = False, touch_now: bool = False) -> None:
        """Touch ``run``'s row while it runs (``save``: store it ``in_progress`` first, only by the run that owns
        it; ``touch_now``: the first touch at once, not after ``ALIVE_EVERY_S``); stop its worker if the row was
        closed meanwhile."""
        response_id, request_id = run.response_id, run.request.request_id
        if save:
            try:
                await self._responses.save(run.record(run.json("in_progress")), hold=False)
            except Exception as exc:  # Postgres away: the stream goes on, not resumable from another gateway
                log.warning("could not store streamed response %s as it began: %r", response_id, exc)
        wait = 0.0 if touch_now else ALIVE_EVERY_S
        while True:
            await asyncio.sleep(wait)
            wait = ALIVE_EVERY_S
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
