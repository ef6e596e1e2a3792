"""The shapes of OpenAI responses built from the workers' deltas: whole bodies, stream chunks, usage, tool calls.

No I/O: ``CompletionService`` (gateway/serving.py) feeds deltas in and sends what comes out. The pieces a
batch line shares (usage, choices, tool calls) are domain/api/shapes.py's.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import msgspec

from switchyard.domain.api.shapes import Kind, choice_json, usage_json
from switchyard.gateway.logprobs import LogprobsFormatter
from switchyard.shared.messages import (
    GenerateRequest,
    TokenDelta,
    TokenLogprob,
    ToolCall,
    ToolCallDelta,
    Usage,
    add_tool_call_parts,
)


@dataclass(slots=True)
class Shape:
    """How one client request is answered."""

    kind: Kind
    stream: bool = False
    include_usage: bool = False
    include_obfuscation: bool = False
    service_tier: str | None = None  # echoed in chat responses (OpenAI's label: default, flex, priority)
    # best_of: each prompt's ``generated_per_prompt`` choices are ranked and the best ``returned_per_prompt`` kept.
    returned_per_prompt: int | None = None
    generated_per_prompt: int | None = None
    extra: dict = field(default_factory=dict)  # fields added to the response (conversation_id, ...)


def sse(payload: dict | str) -> bytes:
    """One server-sent event. msgspec writes the JSON, faster than json.dumps: this runs once per streamed chunk."""
    if isinstance(payload, str):
        return f"data: {payload}\n\n".encode()
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def tool_call_chunk(part: ToolCallDelta) -> dict:
    """One streamed ``tool_calls`` item: the call's first part has its id, type and name."""
    function: dict[str, str | None] = {"arguments": part.arguments}
    item: dict = {"index": part.index}
    if part.id is not None:
        item.update(id=part.id, type="function")
        function = {"name": part.name, **function}
    item["function"] = function
    return item


def header(shape: Shape, request: GenerateRequest, chunk: bool) -> dict:
    """The fields every body or chunk starts with."""
    kind = shape.kind
    out = {"id": kind.id_prefix + request.request_id, "object": kind.object_chunk if chunk else kind.object_full,
           "created": int(request.created_at), "model": request.model}
    if shape.service_tier is not None:
        out["service_tier"] = shape.service_tier
    return {**out, **shape.extra}


@dataclass(slots=True)
class _Choice:
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    finish_reason: str | None = None


class BodyBuilder:
    """A whole (non-streamed) response, from every delta of the request; ``logprobs`` False keeps none (a
    streamed reply gathered only for what it said)."""

    def __init__(self, shape: Shape, request: GenerateRequest, logprobs: bool = True) -> None:
        self._shape, self._request, self._keep_logprobs = shape, request, logprobs
        self._choices = [_Choice() for _ in range(request.sampling.n)]
        self.usage = Usage()

    def add(self, delta: TokenDelta) -> None:
        c = self._choices[delta.index]
        c.texts.append(delta.text)
        if self._keep_logprobs:
            c.logprobs += delta.logprobs or ()
        if delta.tool_calls:
            add_tool_call_parts(c.calls, delta.tool_calls)
        if delta.finish_reason is not None:
            c.finish_reason = delta.finish_reason
        if delta.usage is not None:
            self.usage = delta.usage

    def text(self, index: int) -> str:
        return "".join(self._choices[index].texts)

    def tool_calls(self, index: int) -> list[ToolCall]:
        return self._choices[index].calls

    def finish_reason(self, index: int) -> str | None:
        return self._choices[index].finish_reason

    def _ranked(self) -> list[int]:
        """The choices to return, in order: all, or with best_of the best of each prompt's by log-probability
        per token (OpenAI's "highest log probability per token")."""
        keep, per_prompt = self._shape.returned_per_prompt, self._shape.generated_per_prompt
        generated = self._request.sampling.n
        if keep is None or per_prompt is None or keep >= per_prompt:
            return list(range(generated))

        def score(i: int) -> float:
            entries = self._choices[i].logprobs
            return sum(e.logprob for e in entries) / len(entries) if entries else float("-inf")

        order = []
        for start in range(0, generated, per_prompt):
            group = sorted(range(start, start + per_prompt), key=score, reverse=True)
            order += group[:keep]
        return order

    def body(self, logprobs_asked: bool) -> dict:
        kind = self._shape.kind
        choices = []
        for out_index, i in enumerate(self._ranked()):
            c = self._choices[i]
            formatted = LogprobsFormatter(kind.is_chat, logprobs_asked).format(c.logprobs) if logprobs_asked \
                else None
            choices.append(choice_json(kind, out_index, "".join(c.texts), c.calls, c.finish_reason, formatted))
        return {**header(self._shape, self._request, chunk=False), "choices": choices,
                "usage": usage_json(self.usage)}


class ChunkBuilder:
    """Stream chunks, one delta at a time."""

    def __init__(self, shape: Shape, request: GenerateRequest, text_before: int = 0) -> None:
        """``text_before``: characters of choice 0 its client had before (a stream taken over mid-way), where its
        logprobs' ``text_offset`` counts on from."""
        self._shape = shape
        self._head = header(shape, request, chunk=True)
        # A chunk's fields around its choice are the same in every chunk: written once, and each chunk's JSON is
        # its choice's between them (once per streamed token, so it counts).
        head = msgspec.json.encode(self._head)
        self._before_choice = b"data: " + head[:-1] + (b"," if len(head) > 2 else b"") + b'"choices":['
        self._after_choice = b"]" + (b',"usage":null' if shape.include_usage else b"")
        self._formatters = [LogprobsFormatter(shape.kind.is_chat, request.sampling.logprobs, text_before if i == 0
                                              else 0) for i in range(request.sampling.n)]

    def opening(self, index: int) -> bytes:
        """A chat choice's first chunk: its role."""
        return self._chunk(index, {"role": "assistant", "content": ""}, None)

    def from_delta(self, delta: TokenDelta) -> list[bytes]:
        out = []
        if delta.text or delta.tool_calls:
            body: dict = {}
            if delta.text:
                body["content"] = delta.text
            if delta.tool_calls:
                body["tool_calls"] = [tool_call_chunk(p) for p in delta.tool_calls]
            out.append(self._chunk(delta.index, body, None, delta.logprobs))
        if delta.finish_reason is not None:
            # The final delta may carry text too: it went out above, and the finish goes on its own chunk like
            # OpenAI's. Tokens whose text was all cut (a stop string) still get their logprobs here.
            out.append(self._chunk(delta.index, {}, delta.finish_reason,
                                   None if delta.text or delta.tool_calls else delta.logprobs))
        return out

    def usage(self, usage: Usage) -> bytes:
        return sse({**self._head, "choices": [], "usage": usage_json(usage)})

    def _chunk(self, index: int, delta: dict, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None = None) -> bytes:
        formatted = self._formatters[index].format(logprobs) if logprobs else None
        if self._shape.kind.is_chat:
            choice = {"index": index, "delta": delta, "logprobs": formatted, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": delta.get("content", ""), "logprobs": formatted,
                      "finish_reason": finish_reason}
        after = self._after_choice
        if self._shape.include_obfuscation:
            # Random padding of random length: the size of an encrypted chunk does not tell its token's length.
            after += b',"obfuscation":' + msgspec.json.encode(secrets.token_urlsafe(secrets.randbelow(24) + 1))
        return self._before_choice + msgspec.json.encode(choice) + after + b"}\n\n"
