"""Reads tool calls out of a reply as it streams (the format of workers/serving/tool_calls.py).

    text ──▶ content ... <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call> ... content
                 │              │             │                 │
               content      held until     a call delta     argument deltas, as they come
                            the name is    with id and      (the object's closing brace is
                            complete       name              held: it may be the wrapper's)

Text that only might be the start of a tag is held until the next token settles it, so no ``<tool_`` ever
reaches the client as content. A tag whose inside is not a call after all (possible only where decoding was not
constrained) goes out as content, unchanged. Whitespace around calls is dropped, so a reply that is only calls
has no content, as OpenAI's.
"""

from __future__ import annotations

import json
import re

from switchyard.shared.messages import ToolCallDelta
from switchyard.workers.serving.tool_calls import CLOSE, OPEN

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_TEXT, _HEAD_STATE, _ARGS = range(3)


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` are a proper prefix of ``tag`` (held until settled)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


class ToolCallParser:
    """One choice's reply: ``feed`` each piece of text, ``finish`` at the end; both return (content, calls)."""

    def __init__(self, make_id) -> None:
        """``make_id(index)``: the id of the reply's ``index``-th call (tool_calls.call_id)."""
        self._make_id = make_id
        self._state = _TEXT
        self._buffer = ""
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buffer += text
        content, calls = [], []
        while True:
            if self._state == _TEXT:
                at = self._buffer.find(OPEN)
                if at < 0:
                    keep = _partial_suffix(self._buffer, OPEN)
                    out, self._buffer = self._buffer[:len(self._buffer) - keep], self._buffer[len(self._buffer) - keep:]
                    content.append(self._content(out, final=False))
                    break
                content.append(self._content(self._buffer[:at], final=True))
                self._buffer, self._state = self._buffer[at + len(OPEN):], _HEAD_STATE
            elif self._state == _HEAD_STATE:
                head = _HEAD.match(self._buffer)
                if head is None:
                    if CLOSE in self._buffer or not self._could_become_head():
                        content.append(self._not_a_call())
                        continue
                    break
                name = json.loads(f'"{head.group(1)}"')
                calls.append(ToolCallDelta(self.num_calls, id=self._make_id(self.num_calls), name=name))
                self.num_calls += 1
                self._buffer, self._state = self._buffer[head.end():], _ARGS
            else:
                at = self._buffer.find(CLOSE)
                if at < 0:
                    cut = self._args_end(self._buffer)
                    if cut:
                        calls.append(ToolCallDelta(self.num_calls - 1, arguments=self._buffer[:cut]))
                        self._buffer = self._buffer[cut:]
                    break
                args = self._buffer[:at].rstrip()
                args = args[:-1].rstrip() if args.endswith("}") else args  # the wrapper object's own brace
                if args:
                    calls.append(ToolCallDelta(self.num_calls - 1, arguments=args))
                self._buffer, self._state = self._buffer[at + len(CLOSE):], _TEXT
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The reply ended (stop, length, ...): whatever is held goes out."""
        content, calls = "", []
        if self._state == _TEXT:
            content = self._content(self._buffer, final=True)
        elif self._state == _HEAD_STATE:
            content = self._not_a_call()
        elif self._buffer.strip():  # cut off inside a call's arguments (max_tokens): they are what they are
            calls.append(ToolCallDelta(self.num_calls - 1, arguments=self._buffer.rstrip()))
        self._buffer = ""
        return content, calls

    def _content(self, text: str, final: bool) -> str:
        """Content to send; once a call was made, whitespace is held (it may only separate calls) until real
        text follows it, and dropped at the end."""
        if not self.num_calls or text.strip():
            return text
        if not final:
            self._buffer = text + self._buffer
        return ""

    def _could_become_head(self) -> bool:
        """Whether the text after the tag can still grow into ``{"name": "...", "arguments": ``."""
        probe = re.sub(r"\s+", "", self._buffer)
        return '{"name":"'.startswith(probe) or probe.startswith('{"name":"')

    def _not_a_call(self) -> str:
        text, self._buffer, self._state = OPEN + self._buffer, "", _TEXT
        return text

    @staticmethod
    def _args_end(text: str) -> int:
        """How much of ``text`` (inside a call's arguments, no closing tag yet) is surely arguments: all but a
        last ``}`` with only whitespace and the start of the closing tag after it."""
        brace = text.rfind("}")
        if brace < 0:
            return len(text) - _partial_suffix(text, CLOSE)
        tail = text[brace + 1:].lstrip()
        if CLOSE.startswith(tail):
            return brace
        return len(text) - _partial_suffix(text, CLOSE)
