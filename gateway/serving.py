"""Chat and text completions: an admitted ticket and its body → wire request(s) → relay → OpenAI response or SSE
stream.

The request path reads top to bottom: (admitted: domain/admission) → build the wire request (one per prompt) →
publish → await the worker's first message (so errors such as context_length_exceeded still get their HTTP status)
→ answer → settle the ticket with the tokens used. The response shapes live in gateway/completion_shapes.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from fastapi.responses import JSONResponse, Response

from switchyard.domain.admission.pipeline import Pipeline
from switchyard.domain.admission.service_tier import flex_refusal
from switchyard.domain.admission.ticket import ServiceTier, Ticket
from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.api.shapes import CHAT, TEXT
from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.domain.limits import text_tokens
from switchyard.domain.publish import QueueUnavailable
from switchyard.domain.registry import ModelRegistry
from switchyard.gateway.affinity import AffinityIndex
from switchyard.gateway.client_watch import BoundedStream, ClientGone, unless_gone
from switchyard.gateway.completion_shapes import BodyBuilder, ChunkBuilder, Shape, sse
from switchyard.gateway.fanout import MergedRelay
from switchyard.gateway.kv_index import KVIndex
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.relay import Relay
from switchyard.gateway.relayed_request import RelayedRequest
from switchyard.gateway.stream_ids import BEFORE_ALL, EventIds, Position
from switchyard.gateway.stream_resume import StreamResumer
from switchyard.shared.config import GatewayConfig
from switchyard.shared.messages import ChatMessage, GenerateRequest, TokenDelta, ToolCall, Usage
from switchyard.shared.tier_store import PolicyCache


@dataclass(slots=True)
class Outcome:
    """How a request ended, for ``on_finish``: choice 0's text, tool calls and finish reason (None: it did not
    finish, e.g. the client went away or the worker failed)."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    request_id: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)

    @property
    def completed(self) -> bool:
        """The reply ended as replies do (not cancelled, failed or filtered)."""
        return self.finish_reason in ("stop", "length", "tool_calls")

    def take(self, reply: BodyBuilder) -> None:
        """Choice 0 of ``reply``, whose deltas are all in."""
        self.text, self.tool_calls = reply.text(0), reply.tool_calls(0)
        self.finish_reason, self.usage = reply.finish_reason(0), reply.usage


def admitted_service(ticket: Ticket) -> ServiceTier:
    """The tier admission chose for ``ticket``: every request served here passed admission, which always sets it."""
    assert ticket.service is not None, f"request {ticket.request_id} served before admission chose its tier"
    return ticket.service


def prompt_tokens_estimate(request: GenerateRequest) -> int:
    """The prompt's tokens before any worker tokenized it: exact for token ids, else the admission's estimate."""
    if request.prompt_token_ids is not None:
        return len(request.prompt_token_ids)
    return text_tokens(len(request.prompt or "") + sum(len(m.content) for m in request.messages or ()))


OnFinish = Callable[[Outcome], Awaitable[None]]
Gone = Callable[[], Awaitable[None]]  # returns once the client has left
CLIENT_GONE = 499  # the status of an answer nobody reads (nginx's "client closed request")
QUEUE_RETRY_S = 1.0  # between tries of a queue that was unavailable (start's queue_wait_s)


class CompletionService:
    def __init__(self, relay: Relay, registry: ModelRegistry, tier_policies: PolicyCache, admission: Pipeline,
                 config: GatewayConfig, metrics: GatewayMetrics | None = None,
                 affinity: AffinityIndex | KVIndex | None = None, resumer: StreamResumer | None = None) -> None:
        """``admission``: settles each ticket once its request ended. ``affinity``: which worker holds a
        conversation's prefix (None: every request to the shared queue). ``resumer``: takes over streams whose
        gateway died (None: Last-Event-ID is refused)."""
        self._relay = relay
        self._resumer = resumer
        self._affinity = affinity
        self._metrics = metrics or GatewayMetrics()
        self._registry = registry
        self._tier_policies = tier_policies
        self._admission = admission
        self._config = config

    async def chat(self, body: ChatCompletionRequest, ticket: Ticket, messages: list[ChatMessage] | None = None,
                   on_finish: OnFinish | None = None, extra: dict | None = None, left_out: int = 0,
                   gone: Gone | None = None):
        """``messages``/``on_finish``/``extra``/``left_out`` serve conversations: a server-assembled history
        (truncated by the worker to fit), a callback with the reply once it ends, fields added to the response,
        and how many older messages the history left out before the worker dropped any. ``gone``: returns once
        the client has left (client_watch.until_gone): the request is then stopped, streamed or not."""
        fields = body.wire_fields()
        if messages is not None:
            fields["messages"] = messages
        request = await self.wire_request(body, ticket, truncate_history=messages is not None,
                                          resumable_s=self.resumable_s(body.stream), **fields)
        shape = Shape(CHAT, body.stream, body.include_usage, body.include_obfuscation, admitted_service(ticket).label,
                      extra=extra or {})
        return await self._serve(request, [request], shape, ticket, on_finish, left_out=left_out, gone=gone)

    async def completion(self, body: CompletionRequest, ticket: Ticket, gone: Gone | None = None):
        prompts = body.prompts
        # Several prompts stream as one: their parts' deltas interleave, and no position says where a client is.
        outer = await self.wire_request(body, ticket, resumable_s=self.resumable_s(body.stream and len(prompts) == 1),
                                        **body.wire_fields(prompts[0]))
        parts = [outer] if len(prompts) == 1 else [
            msgspec.structs.replace(outer, request_id=f"{outer.request_id}-p{i}", **body.wire_fields(p))
            for i, p in enumerate(prompts)]
        if len(parts) > 1:  # one request as the client sees it: every prompt's choices
            outer = msgspec.structs.replace(outer, sampling=msgspec.structs.replace(
                outer.sampling, n=outer.sampling.n * len(parts)))
        shape = Shape(TEXT, body.stream, body.include_usage, body.include_obfuscation,
                      returned_per_prompt=body.n if body.num_generated > body.n else None,
                      generated_per_prompt=body.num_generated)
        return await self._serve(outer, parts, shape, ticket, logprobs_asked=body.logprobs is not None, gone=gone)

    async def resume_chat(self, body: ChatCompletionRequest, auth: AuthContext, last_event_id: str):
        """A chat stream resumed from ``last_event_id`` (gateway/stream_resume.py): nothing admitted again."""
        label = body.service_tier if body.service_tier in ("flex", "priority") else "default"
        shape = Shape(CHAT, True, body.include_usage, body.include_obfuscation, label)
        return await self._resume(shape, auth, last_event_id)

    async def resume_completion(self, body: CompletionRequest, auth: AuthContext, last_event_id: str):
        shape = Shape(TEXT, True, body.include_usage, body.include_obfuscation)
        return await self._resume(shape, auth, last_event_id)

    async def _resume(self, shape: Shape, auth: AuthContext, last_event_id: str):
        if self._resumer is None or not self._config.stream_resume_window_s:
            raise OpenAIError(400, "This gateway does not resume streams (stream_resume_window_s is 0).",
                              code="unsupported_parameter", param="Last-Event-ID")
        relayed, first, position, text_before = await self._resumer.take_over(last_event_id, auth.tenant_id)
        request_id = relayed.request.request_id
        return BoundedStream(self._stream(relayed, first, shape, None, Outcome(request_id=request_id), None, position,
                                          text_before),
                             send_timeout_s=self._config.stream_send_timeout_s,
                             max_buffered_bytes=self._config.stream_max_buffered_bytes,
                             buffered=lambda: relayed.buffered_bytes, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Request-Id": request_id})

    @property
    def queue_timeout_s(self) -> float:
        """How long an interactive request may wait for a worker (``gateway.queue_timeout_s``)."""
        return self._config.queue_timeout_s

    def resumable_s(self, stream: bool) -> float:
        """How long a stream whose gateway dies waits at its worker to be resumed (0: not resumable)."""
        return self._config.stream_resume_window_s if stream else 0.0

    async def wire_request(self, body, ticket: Ticket, **fields) -> GenerateRequest:
        """The wire request of an admitted ``ticket``: its ids, tier, deadline and tenant, ``body``'s end user and
        metadata, and ``fields`` (what the body asks the worker for)."""
        service = admitted_service(ticket)
        policy = (await self._tier_policies.get())[service.tier]
        now = time.time()
        # The tier's wait limit, live from ops; an interactive gateway caps it (queue_timeout_s), a flex request
        # waits longer (flex_wait_s).
        wait_s = self._config.flex_wait_s if service.is_flex else self._config.queue_timeout_s
        return GenerateRequest(
            request_id=ticket.request_id,
            model=ticket.model,
            tier=service.tier,
            created_at=now,
            deadline_at=now + min(policy.max_wait_s, wait_s),
            tenant_id=ticket.auth.tenant_id,
            api_key_id=ticket.auth.key_id,
            shared_prefix_cache=self._config.shared_prefix_cache,
            end_user=body.end_user,
            metadata=getattr(body, "metadata", None),  # chat only
            safety=ticket.safety,
            **fields,
        )

    async def _submit_when_queue_back(self, request: GenerateRequest, parts: list[GenerateRequest],
                                      wait_s: float) -> RelayedRequest | MergedRelay:
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return await self._submit(request, parts)
            except QueueUnavailable:  # nothing was queued (JetStream dedupes a publish that did land, by its id)
                if time.monotonic() + QUEUE_RETRY_S > deadline:
                    raise
                await asyncio.sleep(QUEUE_RETRY_S)

    async def _submit(self, request: GenerateRequest, parts: list[GenerateRequest]) -> RelayedRequest | MergedRelay:
        if len(parts) == 1:
            offer_to = await self._offer_to(parts[0])
            if offer_to is None and await self._worth_prefilling_apart(parts[0]):
                return await self._relay.submit(parts[0], offer_s=self._config.prefill_wait_s, prefill=True)
            return await self._relay.submit(parts[0], offer_to, self._config.affinity_wait_s)
        submitted: list[RelayedRequest] = []
        try:
            for part in parts:
                submitted.append(await self._relay.submit(part))
        except BaseException:  # a later prompt refused (queue full, ...): the ones already queued are cancelled
            merged = MergedRelay(request, submitted)
            await merged.cancel()
            await merged.close()
            raise
        return MergedRelay(request, submitted)

    async def _offer_to(self, request: GenerateRequest) -> str | None:
        """The live worker of the model that holds the request's prefix, if any."""
        if self._affinity is None:
            return None
        worker = await self._affinity.lookup(request)
        if worker is None:
            return None
        live = (await self._registry.models()).get(request.model, [])
        return worker if any(w.worker_id == worker and w.takes_whole_requests for w in live) else None

    async def _worth_prefilling_apart(self, request: GenerateRequest) -> bool:
        """Whether ``request`` goes to its model's prefill pool (disaggregated serving): a live prefill worker, a
        prompt long enough that computing it elsewhere and moving its KV beats computing it where it decodes
        (``prefill_min_prompt_tokens``), and a request a decode worker can continue from its first token (one
        choice, no tools, as any continuation)."""
        if (request.sampling.n != 1 or request.tool_use is not None or request.embed is not None
                or request.resume is not None or request.sampling.max_tokens == 1):
            return False
        if prompt_tokens_estimate(request) < self._config.prefill_min_prompt_tokens:
            return False
        live = (await self._registry.models()).get(request.model, [])
        return any(w.takes_prefills for w in live)

    async def _remember(self, relayed, outcome: Outcome) -> None:
        """Where this reply's conversation is cached now (for its next turn)."""
        if self._affinity is not None and outcome.completed:
            await self._affinity.record(relayed.request, outcome.text, outcome.tool_calls,
                                        getattr(relayed, "worker_id", None))

    async def start(self, request: GenerateRequest, ticket: Ticket, parts: list[GenerateRequest] | None = None,
                    gone: Gone | None = None, queue_wait_s: float = 0.0) -> tuple[RelayedRequest | MergedRelay,
                                                                                   TokenDelta]:
        """Queue ``request`` (or its ``parts``, one per prompt) and wait for the worker's first message. A request
        that could not start settles its ticket with nothing used and raises (a flex request's refusal its own
        way); one whose client went away meanwhile (``gone``) is stopped and raises ClientGone.

        ``queue_wait_s``: how long to keep trying while the queue is unavailable (NATS restarting), for a request
        no client waits on the line for (a background response, told ``queued`` already); 0: a client hears 503
        and retries itself."""
        try:
            try:
                self._metrics.served_models.add(request.model)
                relayed = await self._submit_when_queue_back(request, parts or [request], queue_wait_s)
                try:
                    first = await unless_gone(relayed.first(), gone)
                except BaseException:
                    await relayed.cancel()  # the client left while it waited: taken or not, it must not run
                    await relayed.close()
                    raise
            except ClientGone:
                await self._admission.settle(ticket, None)  # a worker may have taken it: it bills what ran
                raise
            except BaseException:
                await self._admission.settle(ticket, 0)  # never ran: whatever it holds goes back
                raise
        except OpenAIError as exc:  # a request that could not start: flex says so its own way
            if not admitted_service(ticket).is_flex:
                raise
            raise flex_refusal(exc, self._config.retry_after_s) from exc
        return relayed, first

    async def end(self, relayed, ticket: Ticket | None, outcome: Outcome, used_tokens: int | None,
                  on_finish: OnFinish | None = None) -> None:
        """After a request's last delta, or when its client went away: stop the worker if it still runs, settle
        the ticket (``used_tokens`` None: unknown here, the worker bills them), hand ``outcome`` on, remember
        where its prefix is cached. One shielded task does all of it, so it is reached from a cancelled response
        task too: a cancelled response's scope cancels every later await (anyio's cancellation is
        level-triggered), so steps awaited one by one would stop at the first."""
        await asyncio.shield(self._end(relayed, ticket, outcome, used_tokens, on_finish))

    async def _end(self, relayed, ticket: Ticket | None, outcome: Outcome, used_tokens: int | None,
                   on_finish: OnFinish | None) -> None:
        try:
            if not relayed.is_finished:
                await relayed.cancel()
            await relayed.close()
        finally:
            if ticket is not None:  # None: a stream taken over from a gateway that died (it held the ticket)
                await self._admission.settle(ticket, used_tokens)
            if on_finish is not None:
                await on_finish(outcome)
            await self._remember(relayed, outcome)

    async def _serve(self, request: GenerateRequest, parts: list[GenerateRequest], shape: Shape, ticket: Ticket,
                     on_finish: OnFinish | None = None, logprobs_asked: bool | None = None, left_out: int = 0,
                     gone: Gone | None = None):
        try:
            relayed, first = await self.start(request, ticket, parts, gone)
        except ClientGone:
            return Response(status_code=CLIENT_GONE)  # nobody reads it
        headers = {"X-Request-Id": request.request_id}
        if request.truncate_history:
            dropped = first.dropped_messages + left_out
            shape.extra = {**shape.extra, "dropped_messages": dropped}
            headers["X-Switchyard-Dropped-Messages"] = str(dropped)
        outcome = Outcome(request_id=request.request_id)
        if shape.stream:
            return BoundedStream(self._stream(relayed, first, shape, ticket, outcome, on_finish),
                                 send_timeout_s=self._config.stream_send_timeout_s,
                                 max_buffered_bytes=self._config.stream_max_buffered_bytes,
                                 buffered=lambda: relayed.buffered_bytes, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", **headers})
        builder = BodyBuilder(shape, relayed.request if len(parts) == 1 else request)
        used: int | None = 0
        try:
            await unless_gone(self._collect(relayed, first, builder), gone)
            outcome.take(builder)
            used = outcome.usage.total_tokens
            return JSONResponse(builder.body(request.sampling.logprobs if logprobs_asked is None else logprobs_asked),
                                headers=headers)
        except ClientGone:  # the worker is told to stop below, and bills what it ran
            used = None
            return Response(status_code=CLIENT_GONE)
        finally:
            await self.end(relayed, ticket, outcome, used, on_finish)

    async def _collect(self, relayed, first: TokenDelta, builder: BodyBuilder) -> None:
        """Every delta of a request answered whole, into ``builder``; raises the error one of them carries."""
        async for delta in self.deltas(relayed, first):
            if delta.error is not None:
                raise OpenAIError.from_info(delta.error)
            builder.add(delta)

    async def deltas(self, relayed, first: TokenDelta) -> AsyncIterator[TokenDelta]:
        """``first``, then every later delta of ``relayed``, timed for the metrics."""
        timer = self._metrics.stream(relayed.request)
        timer.delta(first)
        yield first
        async for delta in relayed.deltas():
            timer.delta(delta)
            yield delta
        timer.finished()

    async def _stream(self, relayed, first: TokenDelta, shape: Shape, ticket: Ticket | None, outcome: Outcome,
                      on_finish: OnFinish | None, after: Position = BEFORE_ALL, text_before: int = 0
                      ) -> AsyncIterator[bytes]:
        """The SSE body. A resumable stream's events carry ids (gateway/stream_ids.py); ``after``: a stream taken
        over, whose client has every event up to there, and ``text_before`` characters of choice 0 before
        ``first``."""
        req = relayed.request
        chunks = ChunkBuilder(shape, req, text_before)
        ids = EventIds(req.request_id, after) if req.resumable_s else None
        usage: Usage | None = None
        reply = BodyBuilder(shape, req, logprobs=False)  # choice 0, for on_finish and the affinity index
        try:
            # Chunks already here are written together, one send and so one socket write instead of one each:
            # deltas that arrived together, and the last delta's chunks with the usage chunk and [DONE] (a
            # one-token stream: headers, the opening, the rest, the end of the body).
            ready: list[bytes] = []
            # A chat's opening chunks go with the request's very first delta; a stream taken over from later on
            # (a continuation's run, or one whose first deltas its worker let go) has a client that had them.
            from_start = (first.attempt, first.seq) == (0, 0)
            opening = [chunks.opening(i) for i in range(req.sampling.n)] if shape.kind.is_chat and from_start else []
            async for delta in self.deltas(relayed, first):
                if delta.usage is not None:
                    usage = delta.usage
                if delta.error is not None:
                    error = [sse(OpenAIError.from_info(delta.error).body())]
                    ready += ids.more(error) if ids is not None else error
                    break
                if delta.index == 0:
                    reply.add(delta)
                made = opening + chunks.from_delta(delta)
                opening = []
                ready += ids.of_delta(delta, made) if ids is not None else made
                if ready and relayed.next_delta_waits:
                    yield b"".join(ready)
                    ready.clear()
            end = [chunks.usage(usage)] if shape.include_usage and usage is not None else []
            end.append(sse("[DONE]"))
            ready += ids.more(end) if ids is not None else end
            yield b"".join(ready)
        finally:
            # Reached on normal end, and on client disconnect (the response task is cancelled): a worker still
            # generating for a gone client must free its slot now. A cancelled stream's tokens are unknown here
            # (the worker bills them): None says so.
            outcome.take(reply)
            outcome.usage = usage or Usage()
            await self.end(relayed, ticket, outcome, usage.total_tokens if usage is not None else None, on_finish)
