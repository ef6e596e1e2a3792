"""Chat and text completions: validated body → wire request(s) → relay → OpenAI response or SSE stream.

The request path reads top to bottom: check the model → build the wire request (one per prompt) → publish →
await the worker's first message (so errors such as context_length_exceeded still get their HTTP status) →
answer. The response shapes live in gateway/responses.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from fastapi.responses import JSONResponse, StreamingResponse

from switchyard.gateway.affinity import AffinityIndex
from switchyard.gateway.auth import AuthContext
from switchyard.gateway.errors import OpenAIError, model_not_found
from switchyard.gateway.fanout import MergedRelay
from switchyard.gateway.limits import Admission, Limiter
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.protocol import ChatCompletionRequest, CompletionRequest
from switchyard.gateway.registry import ModelRegistry
from switchyard.gateway.relay import Relay, RelayedRequest
from switchyard.gateway.request_ids import current_request_id
from switchyard.gateway.responses import CHAT, TEXT, BodyBuilder, ChunkBuilder, Shape, sse
from switchyard.gateway.safety import InputSafety
from switchyard.gateway.service_tiers import ServiceTier, flex_refusal
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


OnFinish = Callable[[Outcome], Awaitable[None]]


class CompletionService:
    def __init__(self, relay: Relay, registry: ModelRegistry, policies: PolicyCache, limiter: Limiter,
                 config: GatewayConfig, metrics: GatewayMetrics | None = None,
                 safety: InputSafety | None = None, affinity: AffinityIndex | None = None) -> None:
        """``safety``: the input filter and tenants' safety policies (None: no filtering at all). ``affinity``:
        which worker holds a conversation's prefix (None: every request to the shared queue)."""
        self._relay = relay
        self._affinity = affinity
        self._safety = safety
        self._metrics = metrics or GatewayMetrics()
        self._registry = registry
        self._policies = policies
        self._limiter = limiter
        self._config = config

    async def chat(self, body: ChatCompletionRequest, service: ServiceTier, auth: AuthContext,
                   admission: Admission, messages: list[ChatMessage] | None = None, on_finish: OnFinish | None = None,
                   extra: dict | None = None):
        """``messages``/``on_finish``/``extra`` serve conversations: a server-assembled history (truncated by the
        worker to fit), a callback with the reply once it ends, and fields added to the response."""
        fields = body.wire_fields()
        if messages is not None:
            fields["messages"] = messages
        request = await self._wire_request(body, service, auth, truncate_history=messages is not None, **fields)
        shape = Shape(CHAT, body.stream, body.include_usage, body.include_obfuscation, service.label,
                      extra=extra or {})
        return await self._serve(request, [request], shape, service, admission, on_finish)

    async def completion(self, body: CompletionRequest, service: ServiceTier, auth: AuthContext,
                         admission: Admission):
        prompts = body.prompts
        outer = await self._wire_request(body, service, auth, **body.wire_fields(prompts[0]))
        parts = [outer] if len(prompts) == 1 else [
            msgspec.structs.replace(outer, request_id=f"{outer.request_id}-p{i}", **body.wire_fields(p))
            for i, p in enumerate(prompts)]
        if len(parts) > 1:  # one request as the client sees it: every prompt's choices
            outer = msgspec.structs.replace(outer, sampling=msgspec.structs.replace(
                outer.sampling, n=outer.sampling.n * len(parts)))
        shape = Shape(TEXT, body.stream, body.include_usage, body.include_obfuscation,
                      returned_per_prompt=body.n if body.num_generated > body.n else None,
                      generated_per_prompt=body.num_generated)
        return await self._serve(outer, parts, shape, service, admission, logprobs_asked=body.logprobs is not None)

    async def _wire_request(self, body, service: ServiceTier, auth: AuthContext, **fields) -> GenerateRequest:
        policy = (await self._policies.get())[service.tier]
        now = time.time()
        # The tier's wait limit, live from ops; an interactive gateway caps it (queue_timeout_s), a flex request
        # waits longer (flex_wait_s).
        wait_s = self._config.flex_wait_s if service.is_flex else self._config.queue_timeout_s
        return GenerateRequest(
            request_id=current_request_id(),
            model=body.model,
            tier=service.tier,
            created_at=now,
            deadline_at=now + min(policy.max_wait_s, wait_s),
            tenant_id=auth.tenant_id,
            api_key_id=auth.key_id,
            shared_prefix_cache=self._config.shared_prefix_cache,
            end_user=body.end_user,
            metadata=getattr(body, "metadata", None),  # chat only
            safety=self._safety.wire_policy(auth) if self._safety is not None else None,
            **fields,
        )

    async def _submit(self, request: GenerateRequest, parts: list[GenerateRequest]) -> RelayedRequest | MergedRelay:
        if len(parts) == 1:
            return await self._relay.submit(parts[0], await self._offer_to(parts[0]), self._config.affinity_wait_s)
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
        return worker if any(w.worker_id == worker for w in live) else None

    async def _remember(self, relayed, outcome: Outcome) -> None:
        """Where this reply's conversation is cached now (for its next turn)."""
        if self._affinity is not None and outcome.completed:
            await self._affinity.record(relayed.request, outcome.text, outcome.tool_calls,
                                        getattr(relayed, "worker_id", None))

    async def _serve(self, request: GenerateRequest, parts: list[GenerateRequest], shape: Shape,
                     service: ServiceTier, admission: Admission, on_finish: OnFinish | None = None,
                     logprobs_asked: bool | None = None):
        try:
            try:
                if not await self._registry.is_served(request.model):
                    raise model_not_found(request.model)
                self._metrics.served_models.add(request.model)
                if self._safety is not None:  # the input filter: a refused request is never queued
                    await self._safety.screen(request, parts)
                relayed = await self._submit(request, parts)
                try:
                    first = await relayed.first()
                except BaseException:
                    await relayed.close()
                    raise
            except BaseException:
                await self._limiter.settle(admission, 0)  # never ran: the whole reservation goes back
                raise
        except OpenAIError as exc:  # a request that could not start: flex says so its own way
            raise flex_refusal(exc, self._config.retry_after_s) if service.is_flex else exc
        if request.truncate_history:
            shape.extra = {**shape.extra, "dropped_messages": first.dropped_messages}
        headers = {"X-Request-Id": request.request_id}
        if request.truncate_history:
            headers["X-Switchyard-Dropped-Messages"] = str(first.dropped_messages)
        outcome = Outcome(request_id=request.request_id)
        if shape.stream:
            return StreamingResponse(self._stream(relayed, first, shape, admission, outcome, on_finish),
                                     media_type="text/event-stream", headers={"Cache-Control": "no-cache", **headers})
        try:
            builder = BodyBuilder(shape, relayed.request if len(parts) == 1 else request)
            async for delta in self._all_deltas(relayed, first):
                if delta.error is not None:
                    raise OpenAIError.from_info(delta.error)
                builder.add(delta)
            outcome.take(builder)
            return JSONResponse(builder.body(request.sampling.logprobs if logprobs_asked is None else logprobs_asked),
                                headers=headers)
        finally:
            if not relayed.is_finished:
                await relayed.cancel()
            await relayed.close()
            await self._limiter.settle(admission, outcome.usage.total_tokens)
            if on_finish is not None:
                await on_finish(outcome)
            await self._remember(relayed, outcome)

    async def _all_deltas(self, relayed, first: TokenDelta) -> AsyncIterator[TokenDelta]:
        timer = self._metrics.stream(relayed.request)
        timer.delta(first)
        yield first
        async for delta in relayed.deltas():
            timer.delta(delta)
            yield delta
        timer.finished()

    async def _stream(self, relayed, first: TokenDelta, shape: Shape, admission: Admission, outcome: Outcome,
                      on_finish: OnFinish | None) -> AsyncIterator[bytes]:
        req = relayed.request
        chunks = ChunkBuilder(shape, req)
        usage: Usage | None = None
        reply = BodyBuilder(shape, req, logprobs=False)  # choice 0, for on_finish and the affinity index
        try:
            if shape.kind.is_chat:
                for i in range(req.sampling.n):
                    yield chunks.opening(i)
            async for delta in self._all_deltas(relayed, first):
                if delta.usage is not None:
                    usage = delta.usage
                if delta.error is not None:
                    yield sse(OpenAIError.from_info(delta.error).body())
                    break
                if delta.index == 0:
                    reply.add(delta)
                for chunk in chunks.from_delta(delta):
                    yield chunk
            if shape.include_usage and usage is not None:
                yield chunks.usage(usage)
            yield sse("[DONE]")
        finally:
            # Reached on normal end, and on client disconnect (the response task is cancelled): a worker still
            # generating for a gone client must free its slot now.
            if not relayed.is_finished:
                await asyncio.shield(relayed.cancel())
            await relayed.close()
            # A cancelled stream's tokens are unknown here (the worker bills them): keep the reservation then.
            used = usage.total_tokens if usage is not None else admission.reserved_tokens
            await asyncio.shield(self._limiter.settle(admission, used))
            outcome.take(reply)
            outcome.usage = usage or Usage()
            if on_finish is not None:
                await asyncio.shield(on_finish(outcome))
            await asyncio.shield(self._remember(relayed, outcome))
