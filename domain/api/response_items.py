"""The Responses API's items: what ``input`` may hold, how items are kept (``input_items``, a stored response's
``output``) and how a run of items becomes the chat messages a worker reads.

    input (string, or items) ─▶ parse_input ─▶ items as stored (each with an id) ─▶ to_messages ─▶ [ChatMessage]
    a reply (text, tool calls) ─▶ output_items ─▶ the response's ``output`` (and, sent back, more input)

Items honoured: messages (roles user, system, developer, assistant; text parts ``input_text``/``output_text``,
``refusal``), ``function_call`` and ``function_call_output``. Any other item or part (images, files, audio,
reasoning, hosted tools' calls, item references) is refused with a 400 naming where it is. Items are lenient about
the fields a client copies back from an earlier response (``status``, ``annotations``, ``logprobs``): they say
nothing about what to generate next.
"""

from __future__ import annotations

import secrets
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from switchyard.domain.api.fields import unsupported, validated
from switchyard.shared.messages import ChatMessage, ToolCall

TEXT_PARTS = ("input_text", "output_text")


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


class _Message(_Lenient):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[dict[str, Any]]


class _FunctionCall(_Lenient):
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class _FunctionCallOutput(_Lenient):
    call_id: str
    output: str | list[dict[str, Any]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


def _text(content: str | list[dict[str, Any]], where: str) -> str:
    """A message's (or a tool output's) text; a part that is not text is refused."""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        if kind in TEXT_PARTS:
            if not isinstance(part.get("text"), str):
                raise unsupported(f"{where}.content[{j}].text", "A text part's text must be a string.")
            texts.append(part["text"])
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            texts.append(part["refusal"])
        else:
            raise unsupported(f"{where}.content[{j}]", f"Content parts of type {kind!r} are not supported: only "
                                                       "text (input_text, output_text).")
    return "".join(texts)


def parse_input(value: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as stored items, each with an id; raises a refusal naming the item that cannot be honoured."""
    if isinstance(value, str):
        return [message_item("user", value)]
    items = []
    for i, raw in enumerate(value):
        where = f"input[{i}]"
        if not isinstance(raw, dict):
            raise unsupported(where, f"{where} must be an object.")
        kind = raw.get("type", "message")
        if kind == "message":
            m = validated(_Message, raw, where)
            items.append(message_item(m.role, _text(m.content, where),
                                      "output_text" if m.role == "assistant" else "input_text"))
        elif kind == "function_call":
            c = validated(_FunctionCall, raw, where)
            items.append(function_call_item(c.call_id, c.name, c.arguments, c.id))
        elif kind == "function_call_output":
            o = validated(_FunctionCallOutput, raw, where)
            items.append({"id": new_id("fco"), "type": "function_call_output", "call_id": o.call_id,
                          "output": _text(o.output, where), "status": "completed"})
        else:
            raise unsupported(where, f"Input items of type {kind!r} are not supported: only messages, "
                                     "function_call and function_call_output.")
    return items


def message_item(role: str, text: str, part_type: str = "input_text", item_id: str | None = None,
                 status: str = "completed") -> dict[str, Any]:
    part: dict[str, Any] = {"type": part_type, "text": text}
    if part_type == "output_text":
        part.update(annotations=[], logprobs=[])
    return {"id": item_id or new_id("msg"), "type": "message", "role": role, "status": status, "content": [part]}


def function_call_item(call_id: str, name: str, arguments: str, item_id: str | None = None,
                       status: str = "completed") -> dict[str, Any]:
    return {"id": item_id or f"fc_{call_id}", "type": "function_call", "status": status, "call_id": call_id,
            "name": name, "arguments": arguments}


def output_items(request_id: str, text: str, calls: list[ToolCall], status: str = "completed") -> list[dict[str, Any]]:
    """A reply as the response's ``output``: its message (when it said something, or nothing at all), then one
    ``function_call`` item per call. Ids come from the request id, so a stream's items and the stored ones agree."""
    items = []
    if text or not calls:
        items.append(message_item("assistant", text, "output_text", output_message_id(request_id), status))
    items += [function_call_item(c.id, c.name, c.arguments) for c in calls]
    return items


def output_message_id(request_id: str) -> str:
    return f"msg_{request_id}"


def item_text(item: dict[str, Any]) -> str:
    """The text an item carries (what the input filter judges and the token estimate counts)."""
    if item["type"] == "message":
        return "".join(p.get("text", "") for p in item["content"])
    text: str = item["arguments"] if item["type"] == "function_call" else item.get("output", "")
    return text


def to_messages(items: list[dict[str, Any]]) -> list[ChatMessage]:
    """Chat messages from items, in order: a function call joins the assistant message just before it (as a chat
    reply holds its text and its calls), and a tool's output answers its call by ``call_id``."""
    messages: list[ChatMessage] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] in ("system", "developer") else item["role"]
            messages.append(ChatMessage(role, item_text(item)))
        elif kind == "function_call":
            call = ToolCall(item["call_id"], item["name"], item["arguments"])
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = ChatMessage("assistant", last.content, tool_calls=[*(last.tool_calls or ()), call])
            else:
                messages.append(ChatMessage("assistant", "", tool_calls=[call]))
        elif kind == "function_call_output":
            messages.append(ChatMessage("tool", item["output"], tool_call_id=item["call_id"]))
    return messages

