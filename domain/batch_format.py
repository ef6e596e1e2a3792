"""The Batch API's file formats, without I/O: a line's wire request and its result lines out (the input file is
read by domain/batch_input.py).

    input  {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", "body": {"model": ..., ...}}
    output {"id": "batch_req_…", "custom_id": "a", "response": {"status_code": 200, "request_id": "batch_req_…",
            "body": <the same JSON a non-streaming chat/completions answer has>}, "error": null}

Each line's request id is derived from (batch id, custom_id), so every publish of a line, by any gateway, after
any restart, carries the same id: JetStream's publish dedupe and the usage writer's ``ON CONFLICT (request_id)``
then make re-submission safe, and a line is never billed twice.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.api.shapes import CHAT, TEXT, choice_json, usage_json
from switchyard.shared.messages import BatchResult, ErrorInfo, GenerateRequest
from switchyard.shared.tiers import BATCH_COMPLETION_WINDOW_S

ENDPOINTS: dict[str, type[ChatCompletionRequest] | type[CompletionRequest]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
}
COMPLETION_WINDOWS = {"24h": BATCH_COMPLETION_WINDOW_S}
CANCELLED = {"code": "batch_cancelled", "message": "The batch was cancelled before this request ran."}
EXPIRED = {"code": "batch_expired", "message": "The batch expired before this request ran."}


def request_id_for(batch_id: str, custom_id: str) -> str:
    """Deterministic and NATS-subject safe (hex): the same line of the same batch always gets the same id."""
    digest = hashlib.sha256(f"{batch_id}\x00{custom_id}".encode()).hexdigest()[:32]
    return f"batch_req_{digest}"


def parse_body(endpoint: str, body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
    """A line's body as its endpoint validates it (raises pydantic's ValidationError)."""
    return ENDPOINTS[endpoint].model_validate(body)


def wire_request(endpoint: str, body: dict[str, Any] | ChatCompletionRequest | CompletionRequest, request_id: str, *,
                 tenant_id: str, api_key_id: str | None, created_at: float, deadline_at: float, result_subject: str,
                 tier: str) -> GenerateRequest:
    """The request a line becomes: exactly what the endpoint would publish, on the batch tier. ``body``: as
    stored, or already parsed (``parse_body``)."""
    parsed = parse_body(endpoint, body) if isinstance(body, dict) else body
    fields = parsed.wire_fields() if isinstance(parsed, ChatCompletionRequest) else \
        parsed.wire_fields(parsed.prompts[0])
    return GenerateRequest(request_id=request_id, model=parsed.model, tier=tier, created_at=created_at,
                           deadline_at=deadline_at, tenant_id=tenant_id, api_key_id=api_key_id,
                           result_subject=result_subject, end_user=parsed.end_user,
                           metadata=getattr(parsed, "metadata", None), **fields)


def response_body(endpoint: str, request_id: str, model: str, created_at: float, result: BatchResult) -> dict[str, Any]:
    """The JSON a non-streaming chat/completions (or completions) response has, from a worker's result."""
    kind = CHAT if endpoint == "/v1/chat/completions" else TEXT
    choices = [choice_json(kind, c.index, c.text, c.tool_calls, c.finish_reason) for c in result.choices]
    usage = usage_json(result.usage) if result.usage is not None else None
    return {"id": kind.id_prefix + request_id, "object": kind.object_full, "created": int(created_at),
            "model": model, "choices": choices, "usage": usage}


def error_response(request_id: str, error: ErrorInfo) -> dict[str, Any]:
    """A line the worker answered with an error: the HTTP status and body the endpoint would have returned."""
    return {"status_code": error.status, "request_id": request_id,
            "body": {"error": {"message": error.message, "type": error.type, "param": error.param,
                               "code": error.code}}}


def line_outcome(endpoint: str, request_id: str, model: str, created_at: float, batch_status: str,
                 result: BatchResult) -> tuple[str, dict[str, Any] | None, dict[str, Any] | None]:
    """A line's (status, response, error) from its worker's final result."""
    if result.error is not None:
        if result.error.code == "cancelled":
            return "cancelled", None, CANCELLED
        return "failed", error_response(request_id, result.error), None
    stopping = batch_status in ("cancelling", "cancelled", "expired")
    if stopping and any(c.finish_reason == "cancelled" for c in result.choices):
        return "cancelled", None, CANCELLED
    body = response_body(endpoint, request_id, model, created_at, result)
    return "completed", {"status_code": 200, "request_id": request_id, "body": body}, None


def output_line(custom_id: str, request_id: str, response: dict[str, Any] | None,
                error: dict[str, Any] | None) -> bytes:
    return json.dumps({"id": request_id, "custom_id": custom_id, "response": response, "error": error},
                      separators=(",", ":"), ensure_ascii=False).encode() + b"\n"


@dataclass(slots=True)
class ResultFiles:
    """What a finished batch publishes: completed lines, the others, and the counts and usage over them."""

    output: bytearray = field(default_factory=bytearray)
    errors: bytearray = field(default_factory=bytearray)
    counts: dict[str, int] = field(default_factory=lambda: {"total": 0, "completed": 0, "failed": 0})
    usage: dict[str, Any] = field(default_factory=lambda: {
        "input_tokens": 0, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 0,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 0})

    def add(self, custom_id: str, request_id: str, status: str, response: dict[str, Any] | None,
            error: dict[str, Any] | None) -> None:
        line = output_line(custom_id, request_id, response, error)
        self.counts["total"] += 1
        if status != "completed":  # failed, or cancelled/expired (counted in neither, like OpenAI)
            self.counts["failed"] += status == "failed"
            self.errors += line
            return
        self.counts["completed"] += 1
        self.output += line
        assert response is not None  # a completed line has its response
        tokens = response["body"].get("usage") or {}
        self.usage["input_tokens"] += tokens.get("prompt_tokens", 0)
        self.usage["input_tokens_details"]["cached_tokens"] += \
            (tokens.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        self.usage["output_tokens"] += tokens.get("completion_tokens", 0)
        self.usage["total_tokens"] = self.usage["input_tokens"] + self.usage["output_tokens"]
