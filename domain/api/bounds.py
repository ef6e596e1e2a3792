"""What one request body may ask the platform to do, checked before it is queued: the sizes that bound what it costs
a worker (tokenizing, rendering the chat template, compiling a grammar), whoever sent it.

    bound                    setting (GatewayConfig.limits)   OpenAI's
    messages (a response's   max_messages (2048)              2048
      input items)
    each stop string         max_stop_chars (1024)            none documented (at most 4 strings: both)
    schemas (response_format max_schema_bytes (128 KiB)       structured outputs: 5000 properties, 10 levels,
      and tools, serialized)                                    120 000 characters of names and values
    tools                    128 (domain/api/fields.py)       128

The bounds are read twice, by the same rule: off the decoded JSON before it is validated into its model
(``check_raw_bounds``: refusing a huge body must not cost the gateway's event loop what validating it would), and
off the model (``check_bounds``, with a conversation's history counted in). The schemas are serialized once: the
model's check takes the sizes the raw one measured (``schema_sizes``; the model holds the same schemas), and
measures them itself only where no raw check ran (a batch line, a conversation's turn).

The worker bounds what still gets through (a batch line of an older file, another gateway's settings): its grammar
compiler runs on a fuel budget (``worker.grammar_lexer_fuel``) and refuses with 400 when it runs out.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

import msgspec

from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.api.responses import ResponseCreate
from switchyard.domain.errors import OpenAIError
from switchyard.shared.config import RequestLimits


def _too_long(param: str, message: str, code: str = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, code=code, param=param)


# The serialized sizes of the schemas a request's output must follow, in bytes: its format's (response_format's,
# or a response's text.format's), and its tools' together.
SchemaSizes = tuple[int, int]


def _size(schema: Any) -> int:
    """A schema's size as compact JSON (UTF-8): what the limit counts."""
    return len(msgspec.json.encode(schema)) if schema else 0


def schema_bytes(body: ChatCompletionRequest) -> SchemaSizes:
    """The serialized sizes of the schemas the request's output must follow: response_format's, the tools'."""
    fmt = body.response_format
    return (_size(fmt.json_schema.schema_ if fmt is not None and fmt.json_schema is not None else None),
            sum(_size(t.function.parameters) for t in body.tools or ()))


def check_bounds(body: ChatCompletionRequest | CompletionRequest, limits: RequestLimits,
                 num_history: int = 0, schema_sizes: SchemaSizes | None = None) -> None:
    """Raise a 400 naming the parameter when ``body`` asks for more than ``limits`` allow. ``num_history``: the
    messages a conversation's server-side history adds to it. ``schema_sizes``: its schemas' sizes as
    ``check_raw_bounds`` measured them off the body this was validated from (None: measured here)."""
    if not isinstance(body, ChatCompletionRequest):
        return _check(body.stop or (), None, 0, 0, limits)
    sizes = schema_bytes(body) if schema_sizes is None else schema_sizes
    _check(body.stop or (), len(body.messages) + num_history, *sizes, limits)


def check_response_bounds(body: ResponseCreate, limits: RequestLimits, num_history: int = 0,
                          schema_sizes: SchemaSizes | None = None) -> None:
    """``check_bounds`` for a Responses API body: its input items (and ``num_history``, the earlier turns of its
    chain or conversation) count as messages, its ``text.format`` schema and its tools' as schemas."""
    if schema_sizes is None:
        fmt = body.text.format if body.text is not None else None
        schema_sizes = (_size(fmt.schema_ if fmt is not None else None),
                        sum(_size(t.get("parameters")) for t in body.tools or ()))
    _check((), len(body.items) + num_history, *schema_sizes, limits, messages_param="input")


Kind = Literal["chat", "completion", "response"]


def check_raw_bounds(body: Any, limits: RequestLimits, kind: Kind) -> SchemaSizes | None:
    """``check_bounds`` (or ``check_response_bounds``) read off a body as decoded JSON, before it is validated into
    its model: a body far over the bounds is refused for what it cost to read, not what validating it would
    (15,000 messages or an 8,000-branch schema take about 0.1 s of the gateway's event loop to become models, and
    every other request on the gateway waits that long). Whatever is not shaped as expected is left to validation,
    which says what is wrong with it.

    Returns the schemas' sizes it measured, for the model's check (``schema_sizes``) to take instead of
    serializing them again: a body that validates holds the same schemas. None: it measured none (a completion's
    body, or not an object)."""
    if not isinstance(body, dict):
        return None
    stop = body.get("stop")
    stops = [stop] if isinstance(stop, str) else [s for s in stop if isinstance(s, str)] \
        if isinstance(stop, list) else []
    if kind == "completion":
        _check(stops, None, 0, 0, limits)
        return None
    tools = body.get("tools")
    tools = [t for t in tools if isinstance(t, dict)] if isinstance(tools, list) else []
    if kind == "response":
        items = body.get("input")
        fmt = _dict(_dict(body.get("text")).get("format"))
        sizes = (_size(fmt.get("schema")), sum(_size(t.get("parameters")) for t in tools))
        _check((), len(items) if isinstance(items, list) else None, *sizes, limits, messages_param="input")
        return sizes
    messages = body.get("messages")
    described = _dict(_dict(body.get("response_format")).get("json_schema"))
    sizes = (_size(described.get("schema")), sum(_size(_dict(t.get("function")).get("parameters")) for t in tools))
    _check(stops, len(messages) if isinstance(messages, list) else None, *sizes, limits)
    return sizes


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _check(stops: Iterable[str], num_messages: int | None, fmt_size: int, tools_size: int,
           limits: RequestLimits, messages_param: str = "messages") -> None:
    for stop in stops:
        if len(stop) > limits.max_stop_chars:
            raise _too_long("stop", f"Each stop sequence may have at most {limits.max_stop_chars} characters; one "
                                    f"has {len(stop)}.")
    if num_messages is not None and num_messages > limits.max_messages:
        raise _too_long(messages_param, f"Invalid '{messages_param}': array too long. Expected an array with "
                                        f"maximum length {limits.max_messages}, but got an array with length "
                                        f"{num_messages} instead.", code="array_above_max_length")
    if fmt_size + tools_size > limits.max_schema_bytes:
        fmt_param = "text.format" if messages_param == "input" else "response_format"
        param = fmt_param if fmt_size > tools_size else "tools"
        raise _too_long(param, f"The JSON schemas of this request take {fmt_size + tools_size} bytes, over the "
                               f"limit of {limits.max_schema_bytes}: simplify them or split the task.")
