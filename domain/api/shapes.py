"""The pieces of OpenAI responses that every answer is built from, whoever builds it: the gateway's bodies and
stream chunks (gateway/completion_shapes.py), batch output lines (domain/batch_format.py) and stored conversation
messages (domain/conversations.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from switchyard.shared.messages import ToolCall, Usage


@dataclass(frozen=True, slots=True)
class Kind:
    """What differs between chat and text completions in the response shapes."""

    id_prefix: str
    object_full: str
    object_chunk: str
    is_chat: bool


CHAT = Kind("chatcmpl-", "chat.completion", "chat.completion.chunk", True)
TEXT = Kind("cmpl-", "text_completion", "text_completion", False)


def usage_json(usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage`` object (with cached prompt tokens), as every response and batch result line has it."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A whole call as OpenAI writes it in a message (responses, batch output lines, stored conversations)."""
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def tool_call_from_json(item: dict[str, Any]) -> ToolCall:
    return ToolCall(item["id"], item["function"]["name"], item["function"]["arguments"])


def choice_json(kind: Kind, index: int, text: str, calls: list[ToolCall], finish_reason: str | None,
                logprobs: dict[str, Any] | None = None) -> dict[str, Any]:
    """One choice of a whole (non-streamed) response: a chat message (its content null when it only calls tools)
    or a completion's text."""
    if kind.is_chat:
        message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
        if calls:
            message["tool_calls"] = [tool_call_json(call) for call in calls]
        choice = {"index": index, "message": message}
    else:
        choice = {"index": index, "text": text}
    return {**choice, "logprobs": logprobs, "finish_reason": finish_reason}
