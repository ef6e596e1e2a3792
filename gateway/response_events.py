"""A streamed response's semantic events, in OpenAI's order, numbered by ``sequence_number``; no I/O.

    response.created, response.in_progress
    text:   response.output_item.added (message) ─ response.content_part.added ─ response.output_text.delta ...
            ─ response.output_text.done ─ response.content_part.done ─ response.output_item.done
    a call: response.output_item.added (function_call) ─ response.function_call_arguments.delta ...
            ─ response.function_call_arguments.done ─ response.output_item.done
    end:    response.completed | response.incomplete | response.failed (the whole response, with usage),
            or an ``error`` event for a request that failed before its response began

Items get their output index in the order they open, and the final response lists them in that order, so what
a client assembled from the deltas is exactly the final ``output``. The same deltas make the same events, so a
gateway that takes a stream over (GET /v1/responses/{id}?stream=true&starting_after=N) makes them again from the
run's first delta and sends only those after N.
"""

from __future__ import annotations

import json

from switchyard.domain.api.response_items import function_call_item, message_item, output_message_id
from switchyard.shared.messages import ErrorInfo, TokenDelta


def event_bytes(payload: dict) -> bytes:
    return f"event: {payload['type']}\ndata: {json.dumps(payload, separators=(',', ':'))}\n\n".encode()


class ResponseEvents:
    """The events of one streamed response; ``items`` are its output items so far (closed ones complete)."""

    def __init__(self, request_id: str, after: int = -1) -> None:
        """``after``: the events up to this sequence number are numbered but not made (a client resuming the
        stream had them)."""
        self._seq = 0
        self._after = after
        self._message_id = output_message_id(request_id)
        self._text: list[str] | None = None  # the message's text, once its item is open
        self._message_index = 0  # the message's output index, while its item is open
        self._calls: dict[int, int] = {}  # the call's index among the reply's calls → its output index
        self.items: list[dict] = []

    @property
    def num_made(self) -> int:
        """Events numbered so far: the next one's sequence number."""
        return self._seq

    def _event(self, kind: str, **fields) -> bytes:
        seq = self._seq
        self._seq += 1
        if seq <= self._after:
            return b""
        return event_bytes({"type": kind, "sequence_number": seq, **fields})

    def opening(self, response: dict) -> list[bytes]:
        return [self._event("response.created", response=response),
                self._event("response.in_progress", response=response)]

    def delta(self, delta: TokenDelta) -> list[bytes]:
        out: list[bytes] = []
        if delta.text:
            text = self._text if self._text is not None else self._open_message(out)
            text.append(delta.text)
            out.append(self._event("response.output_text.delta", item_id=self._message_id,
                                   output_index=self._message_index, content_index=0, delta=delta.text, logprobs=[]))
        for part in delta.tool_calls or ():
            if part.id is not None:  # a new call opens its item
                self._calls[part.index] = len(self.items)
                item = function_call_item(part.id, part.name or "", "", status="in_progress")
                self.items.append(item)
                out.append(self._event("response.output_item.added", output_index=self._calls[part.index],
                                       item=dict(item)))
            index = self._calls.get(part.index)
            if index is None or not part.arguments:
                continue
            item = self.items[index]
            item["arguments"] += part.arguments
            out.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                   output_index=index, delta=part.arguments))
        return out

    def _open_message(self, out: list[bytes]) -> list[str]:
        """Open the message's item, its events added to ``out``; returns its text so far (none)."""
        text: list[str] = []
        self._text, self._message_index = text, len(self.items)
        item = message_item("assistant", "", "output_text", self._message_id, "in_progress")
        item["content"] = []
        self.items.append(item)
        out += [self._event("response.output_item.added", output_index=self._message_index, item=dict(item)),
                self._event("response.content_part.added", item_id=self._message_id,
                            output_index=self._message_index, content_index=0,
                            part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})]
        return text

    def close(self, status: str) -> list[bytes]:
        """Close every open item with ``status`` (completed, incomplete); a reply with no item at all gets its
        (empty) message, as a whole response has."""
        out: list[bytes] = []
        if self._text is None and not self.items:
            self._open_message(out)
        if self._text is not None:
            text = "".join(self._text)
            item = message_item("assistant", text, "output_text", self._message_id, status)
            part = item["content"][0]
            self.items[self._message_index] = item
            out += [self._event("response.output_text.done", item_id=self._message_id,
                                output_index=self._message_index, content_index=0, text=text, logprobs=[]),
                    self._event("response.content_part.done", item_id=self._message_id,
                                output_index=self._message_index, content_index=0, part=part),
                    self._event("response.output_item.done", output_index=self._message_index, item=item)]
        for index in self._calls.values():
            item = self.items[index]
            item["status"] = status
            out += [self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                name=item["name"], arguments=item["arguments"]),
                    self._event("response.output_item.done", output_index=index, item=item)]
        self._text, self._calls = None, {}
        return out

    def terminal(self, response: dict) -> bytes:
        """The last event: the whole response, named by its status."""
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            response["status"], "response.failed")
        return self._event(kind, response=response)

    def error(self, error: ErrorInfo) -> bytes:
        """An ``error`` event, shaped like OpenAI's."""
        return self._event("error", code=error.code, message=error.message, param=error.param)
