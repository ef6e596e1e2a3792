"""What one request body may ask the platform to do, checked before it is queued: the sizes that bound what it costs
a worker (tokenizing, rendering the chat template, compiling a grammar), whoever sent it.

    bound                    setting (GatewayConfig.limits)   OpenAI's
    messages                 max_messages (2048)              2048
    each stop string         max_stop_chars (1024)            none documented (at most 4 strings: both)
    schemas (response_format max_schema_bytes (128 KiB)       structured outputs: 5000 properties, 10 levels,
      and tools, serialized)                                    120 000 characters of names and values
    tools                    128 (domain/api/fields.py)       128

The worker bounds what still gets through (a batch line of an older file, another gateway's settings): its grammar
compiler runs on a fuel budget (``worker.grammar_lexer_fuel``) and refuses with 400 when it runs out.
"""

from __future__ import annotations

import json
from typing import Any

from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.errors import OpenAIError
from switchyard.shared.config import RequestLimits


def _too_long(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


def _size(schema: dict[str, Any] | None) -> int:
    return len(json.dumps(schema, separators=(",", ":")).encode()) if schema else 0


def schema_bytes(body: ChatCompletionRequest) -> tuple[int, int]:
    """The serialized sizes of the schemas the request's output must follow: response_format's, the tools'."""
    fmt = body.response_format
    return (_size(fmt.json_schema.schema_ if fmt is not None and fmt.json_schema is not None else None),
            sum(_size(t.function.parameters) for t in body.tools or ()))


def check_bounds(body: ChatCompletionRequest | CompletionRequest, limits: RequestLimits,
                 num_history: int = 0) -> None:
    """Raise a 400 naming the parameter when ``body`` asks for more than ``limits`` allow. ``num_history``: the
    messages a conversation's server-side history adds to it."""
    for stop in body.stop or ():
        if len(stop) > limits.max_stop_chars:
            raise _too_long("stop", f"Each stop sequence may have at most {limits.max_stop_chars} characters; one "
                                    f"has {len(stop)}.")
    if not isinstance(body, ChatCompletionRequest):
        return
    num_messages = len(body.messages) + num_history
    if num_messages > limits.max_messages:
        raise _too_long("messages", f"Invalid 'messages': array too long. Expected an array with maximum length "
                                    f"{limits.max_messages}, but got an array with length {num_messages} instead.",
                        code="array_above_max_length")
    fmt_size, tools_size = schema_bytes(body)
    if fmt_size + tools_size > limits.max_schema_bytes:
        param = "response_format" if fmt_size > tools_size else "tools"
        raise _too_long(param, f"The JSON schemas of this request take {fmt_size + tools_size} bytes, over the "
                               f"limit of {limits.max_schema_bytes}: simplify them or split the task.")
