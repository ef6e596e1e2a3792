"""Chat and text completions: validated body → wire request → relay → OpenAI response or SSE stream.

The request path reads top to bottom: check the model → build the wire request → publish → await the worker's
first message (so errors such as context_length_exceeded still get their HTTP status) → answer.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from fastapi.responses import JSONResponse, StreamingResponse

from switchyard.gateway.auth import AuthContext
from switchyard.gateway.errors import OpenAIError, model_not_found
from switchyard.gateway.limits import Admission, Limiter
from switchyard.gateway.logprobs import LogprobsFormatter
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.protocol import ChatCompletionRequest, CompletionRequest
from switchyard.gateway.registry import ModelRegistry
from switchyard.gateway.relay import Relay, RelayedRequest
from switchyard.gateway.request_ids import current_request_id
from switchyard.shared.config import GatewayConfig
from switchyard.shared.messages import ChatMessage, GenerateRequest, TokenDelta, TokenLogprob, Usage
from switchyard.shared.tier_store import PolicyCache


@dataclass(slots=True)
class _Kind:
    """What differs between chat and text completions in the response shapes."""

    id_prefix: str
    object_full: str
    object_chunk: str
    is_chat: bool


CHAT = _Kind("chatcmpl-", "chat.completion", "chat.completion.chunk", True)
TEXT = _Kind("cmpl-", "text_completion", "text_completion", False)


def usage_json(usage: Usage) -> dict:
    """OpenAI's ``usage`` object (with cached prompt tokens), as every response and batch result line has it."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


@dataclass(slots=True)
class Outcome:
    """How a request ended, for ``on_finish``: choice 0's text and finish reason (None: it did not finish,
    e.g. the client went away or the worker failed)."""

    text: str = ""
    finish_reason: str | None = None
    usage: Usage = field(default_factory=Usage)
    parts: list[str] = field(default_factory=list)
    request_id: str = ""


OnFinish = Callable[[Outcome], Awaitable[None]]


class CompletionService:
    def __init__(self, relay: Relay, registry: ModelRegistry, policies: PolicyCache, limiter: Limiter,
                 config: GatewayConfig, metrics: GatewayMetrics | None = None) -> None:
        self._relay = relay
        self._metrics = metrics or GatewayMetrics()
        self._registry = registry
        self._policies = policies
        self._limiter = limiter
        self._config = config

    async def chat(self, body: ChatCompletionRequest, tier: str, auth: AuthContext, admission: Admission,
                   messages: list[ChatMessage] | None = None, on_finish: OnFinish | None = None,
                   extra: dict | None = None):
        """``messages``/``on_finish``/``extra`` serve conversations: a server-assembled history (truncated by the
        worker to fit), a callback with the reply once it ends, and fields added to the response."""
        request = await self._wire_request(body, tier, auth, messages=messages or body.wire_messages(),
                                           sampling=body.sampling(), truncate_history=messages is not None)
        return await self._serve(request, body.stream, body.include_usage, CHAT, admission, on_finish, extra)

    async def completion(self, body: CompletionRequest, tier: str, auth: AuthContext, admission: Admission):
        request = await self._wire_request(body, tier, auth, prompt=body.prompt_text, sampling=body.sampling())
        return await self._serve(request, body.stream, body.include_usage, TEXT, admission)

    async def _wire_request(self, body, tier: str, auth: AuthContext, **fields) -> GenerateRequest:
        policy = (await self._policies.get())[tier]
        now = time.time()
        return GenerateRequest(
            request_id=current_request_id(),
            model=body.model,
            tier=tier,
            created_at=now,
            # The tier's wait limit, live from ops; queue_timeout_s caps it for interactive gateways.
            deadline_at=now + min(policy.max_wait_s, self._config.queue_timeout_s),
            tenant_id=auth.tenant_id,
            api_key_id=auth.key_id,
            shared_prefix_cache=self._config.shared_prefix_cache,
            **fields,
        )

    async def _serve(self, request: GenerateRequest, stream: bool, include_usage: bool, kind: _Kind,
                     admission: Admission, on_finish: OnFinish | None = None, extra: dict | None = None):
        try:
            if not await self._registry.is_served(request.model):
                raise model_not_found(request.model)
            self._metrics.served_models.add(request.model)
            relayed = await self._relay.submit(request)
            try:
                first = await relayed.first()
            except BaseException:
                await relayed.close()
                raise
        except BaseException:
            await self._limiter.settle(admission, 0)  # never ran: the whole reservation goes back
            raise
        extra = {**(extra or {}), **({"dropped_messages": first.dropped_messages} if request.truncate_history else {})}
        headers = {"X-Request-Id": request.request_id}
        if request.truncate_history:
            headers["X-Switchyard-Dropped-Messages"] = str(first.dropped_messages)
        outcome = Outcome(request_id=request.request_id)
        if stream:
            return StreamingResponse(
                self._stream(relayed, first, include_usage, kind, admission, outcome, on_finish, extra),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache", **headers},
            )
        try:
            body = await self._collect(relayed, first, kind, outcome)
            return JSONResponse({**body, **extra}, headers=headers)
        finally:
            if not relayed.is_finished:
                await relayed.cancel()
            await relayed.close()
            await self._limiter.settle(admission, outcome.usage.total_tokens)
            if on_finish is not None:
                await on_finish(outcome)

    async def _all_deltas(self, relayed: RelayedRequest, first: TokenDelta) -> AsyncIterator[TokenDelta]:
        timer = self._metrics.stream(relayed.request)
        timer.delta(first)
        yield first
        async for delta in relayed.deltas():
            timer.delta(delta)
            yield delta
        timer.finished()

    async def _collect(self, relayed: RelayedRequest, first: TokenDelta, kind: _Kind, outcome: "Outcome") -> dict:
        n = relayed.request.sampling.n
        texts = [[] for _ in range(n)]
        logprobs: list[list[TokenLogprob]] = [[] for _ in range(n)]
        finish: list[str | None] = [None] * n
        usage = Usage()
        async for delta in self._all_deltas(relayed, first):
            if delta.error is not None:
                raise OpenAIError.from_info(delta.error)
            texts[delta.index].append(delta.text)
            logprobs[delta.index] += delta.logprobs or ()
            if delta.finish_reason is not None:
                finish[delta.index] = delta.finish_reason
            if delta.usage is not None:
                usage = delta.usage
        choices = []
        for i in range(n):
            text = "".join(texts[i])
            formatted = LogprobsFormatter(kind.is_chat, relayed.request.sampling.logprobs).format(logprobs[i])
            if kind.is_chat:
                choice = {"index": i, "message": {"role": "assistant", "content": text}, "logprobs": formatted}
            else:
                choice = {"index": i, "text": text, "logprobs": formatted}
            choice["finish_reason"] = finish[i]
            choices.append(choice)
        req = relayed.request
        outcome.text, outcome.finish_reason, outcome.usage = choices[0].get("message", {}).get("content", ""), \
            finish[0], usage
        return {
            "id": kind.id_prefix + req.request_id,
            "object": kind.object_full,
            "created": int(req.created_at),
            "model": req.model,
            "choices": choices,
            "usage": usage_json(usage),
        }

    async def _stream(
        self, relayed: RelayedRequest, first: TokenDelta, include_usage: bool, kind: _Kind, admission: Admission,
        outcome: "Outcome", on_finish: OnFinish | None, extra: dict,
    ) -> AsyncIterator[bytes]:
        req = relayed.request
        base = {"id": kind.id_prefix + req.request_id, "object": kind.object_chunk, "created": int(req.created_at),
                "model": req.model, **extra}

        formatters = [LogprobsFormatter(kind.is_chat, req.sampling.logprobs) for _ in range(req.sampling.n)]

        def chunk(index: int, text: str | None, finish_reason: str | None, role: bool = False,
                  logprobs: list[TokenLogprob] | None = None) -> bytes:
            formatted = formatters[index].format(logprobs) if logprobs else None
            if kind.is_chat:
                delta: dict = {"role": "assistant", "content": ""} if role else {}
                if text:
                    delta["content"] = text
                choice = {"index": index, "delta": delta, "logprobs": formatted, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": formatted, "finish_reason": finish_reason}
            payload = {**base, "choices": [choice]}
            if include_usage:
                payload["usage"] = None
            return _sse(payload)

        usage: Usage | None = None
        try:
            if kind.is_chat:
                for i in range(req.sampling.n):
                    yield chunk(i, None, None, role=True)
            async for delta in self._all_deltas(relayed, first):
                if delta.usage is not None:
                    usage = delta.usage
                if delta.error is not None:
                    err = OpenAIError.from_info(delta.error)
                    yield _sse(err.body())
                    break
                if delta.index == 0:
                    outcome.parts.append(delta.text)
                    outcome.finish_reason = delta.finish_reason or outcome.finish_reason
                if delta.text or delta.finish_reason is not None:
                    # The final delta may carry text too: send it, then the finish on its own chunk like OpenAI.
                    if delta.text:
                        yield chunk(delta.index, delta.text, None, logprobs=delta.logprobs)
                    if delta.finish_reason is not None:
                        # Tokens whose text was all cut (a stop string) still get their logprobs, here.
                        yield chunk(delta.index, None, delta.finish_reason,
                                    logprobs=None if delta.text else delta.logprobs)
            if include_usage and usage is not None:
                yield _sse({**base, "choices": [], "usage": usage_json(usage)})
            yield _sse("[DONE]")
        finally:
            # Reached on normal end, and on client disconnect (the response task is cancelled): a worker still
            # generating for a gone client must free its slot now.
            if not relayed.is_finished:
                await asyncio.shield(relayed.cancel())
            await relayed.close()
            # A cancelled stream's tokens are unknown here (the worker bills them): keep the reservation then.
            used = usage.total_tokens if usage is not None else admission.reserved_tokens
            await asyncio.shield(self._limiter.settle(admission, used))
            if on_finish is not None:
                outcome.text = "".join(outcome.parts)
                outcome.usage = usage or Usage()
                await asyncio.shield(on_finish(outcome))
