"""The Responses API's response object, as every answer carries it: a whole body, a stream's
``response.created``/``response.completed`` events, a stored or background response polled later.

    status         when
    queued         a background response not started yet
    in_progress    started (a stream's first events, a background response running)
    completed      the reply ended by itself (stop) or with its tool calls
    incomplete     cut short: max_output_tokens (length) or the output filter (content_filter)
    failed         an error; ``error`` says which ({code, message})
    cancelled      POST /v1/responses/{id}/cancel, or the client went away
"""

from __future__ import annotations

import time
from typing import Any

from switchyard.shared.messages import ErrorInfo, Usage

# finish_reason → (status, incomplete_details reason)
_STATUS = {
    "stop": ("completed", None),
    "tool_calls": ("completed", None),
    "length": ("incomplete", "max_output_tokens"),
    "content_filter": ("incomplete", "content_filter"),
    "cancelled": ("cancelled", None),
}
TERMINAL = ("completed", "incomplete", "failed", "cancelled")


def status_of(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """A reply's finish reason as a response's ``status`` and ``incomplete_details``."""
    status, reason = _STATUS.get(finish_reason or "", ("failed", None))
    return status, None if reason is None else {"reason": reason}


def usage_json(usage: Usage) -> dict[str, Any]:
    """The Responses API's ``usage``: input/output tokens, with the input's cached part."""
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.total_tokens}


def error_json(error: ErrorInfo) -> dict[str, Any]:
    return {"code": error.code or "server_error", "message": error.message}


def response_json(response_id: str, created_at: float, model: str, echo: dict[str, Any], status: str,
                  output: list[dict[str, Any]] | None = None, usage: Usage | None = None,
                  error: ErrorInfo | None = None, incomplete_details: dict[str, Any] | None = None,
                  service_tier: str | None = None) -> dict[str, Any]:
    """The response object. ``echo``: the request's settings as the response repeats them
    (``ResponseCreate.echo``)."""
    base = {"id": response_id, "object": "response", "created_at": int(created_at), "model": model,
            "service_tier": service_tier, **echo}
    return in_state(base, status, output, usage, error, incomplete_details)


def in_state(response: dict[str, Any], status: str, output: list[dict[str, Any]] | None = None,
             usage: Usage | None = None, error: ErrorInfo | None = None,
             incomplete_details: dict[str, Any] | None = None) -> dict[str, Any]:
    """``response`` (any state of it: its id, model and settings are what it keeps) in ``status``, with what that
    state says: its output so far, its usage, its error."""
    return {
        **response, "status": status, "completed_at": int(time.time()) if status in TERMINAL else None,
        "output": output or [], "usage": None if usage is None else usage_json(usage),
        "error": None if error is None else error_json(error), "incomplete_details": incomplete_details,
    }


def output_text(output: list[dict[str, Any]]) -> str:
    """The text of a response's message items (what a conversation keeps as the assistant's reply)."""
    return "".join(p.get("text", "") for item in output if item["type"] == "message" for p in item["content"])
