"""A Batch API input file, read as a stream: lines validated one by one as the bytes come, the caps applied while
reading, so a file costs the memory of a chunk and of the lines in hand, not of the whole file decoded and split.

    chunk ─▶ LineParser.feed ─▶ complete lines (a partial one waits for the next chunk) ─▶ each line validated
             ─▶ InputLines (stored by the caller as they come) | errors (line-numbered, the first MAX_ERRORS)
    finish() ─▶ the last line, and the file-wide errors: empty, too many requests

A line must be a JSON object with a unique string ``custom_id`` Postgres can store, ``method`` POST, ``url`` equal
to the batch's endpoint, and a ``body`` the endpoint itself would accept, non-streaming, within the request
bounds (domain/api/bounds.py). Any failure to read a line (bad UTF-8, bad JSON, nesting so deep the parser gives
up: RecursionError) fails that line alone. Blank lines are skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from switchyard.domain.api.bounds import check_bounds
from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.api.text import UNSTORABLE, describe, field_path
from switchyard.domain.batch_format import ENDPOINTS
from switchyard.domain.errors import OpenAIError
from switchyard.domain.limits import estimate_tokens
from switchyard.shared.config import RequestLimits

MAX_LINES = 50_000
MAX_ERRORS = 100  # a file with thousands of bad lines reports the first ones


@dataclass(frozen=True, slots=True)
class InputLine:
    line_no: int  # 1-based, as an editor shows it
    custom_id: str
    body_json: str  # the body as stored (batch_lines.body, a json column)
    model: str
    estimated_tokens: int = 0  # what it may use, as an interactive request reserves (limits.estimate_tokens)

    @property
    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = json.loads(self.body_json)  # a line's body is stored only once it is an object
        return body


class LineError(Exception):
    """Why one line is refused: its error entry."""

    def __init__(self, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param


def error_entry(line: int | None, code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def _describe(exc: ValidationError) -> tuple[str, str]:
    first = exc.errors()[0]
    param = ".".join(["body", *field_path(first)])
    if first.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    return f"Invalid value for '{param}': {first.get('msg', 'invalid value')}.", param


def _not_in_a_batch(parsed: ChatCompletionRequest | CompletionRequest) -> tuple[str, str] | None:
    """What a line may not ask for in a batch: (message, param), or None."""
    if parsed.stream:
        return "Streaming is not supported in a batch.", "body.stream"
    if isinstance(parsed, ChatCompletionRequest):
        if parsed.service_tier not in (None, "auto", "default"):
            return "A batch runs on the batch tier: service_tier must be auto or default.", "body.service_tier"
        return None
    if len(parsed.prompts) > 1:
        return "One prompt per line in a batch: put each prompt on a line of its own.", "body.prompt"
    if parsed.num_generated > parsed.n:
        return "best_of greater than n is not supported in a batch.", "body.best_of"
    return None


@dataclass(slots=True)
class LineParser:
    """Validates an input file fed in chunks. ``errors`` fills as it goes; ``done`` says reading may stop (the
    error list is full, or the file has more requests than a batch may)."""

    endpoint: str
    limits: RequestLimits = field(default_factory=RequestLimits)
    errors: list[dict[str, Any]] = field(default_factory=list)
    num_lines: int = 0  # requests seen
    estimated_tokens: int = 0  # of the valid lines
    models: dict[str, int] = field(default_factory=dict)  # model -> its first line
    _seen: set[str] = field(default_factory=set)
    _rest: bytes = b""  # a line not yet ended
    _line_no: int = 0

    @property
    def done(self) -> bool:
        return len(self.errors) >= MAX_ERRORS or self.num_lines > MAX_LINES

    def feed(self, chunk: bytes) -> list[InputLine]:
        """The valid lines ended in ``chunk`` (with what came before it)."""
        data = self._rest + chunk
        end = data.rfind(b"\n")
        if end < 0:
            self._rest = data
            return []
        self._rest = data[end + 1:]
        return self._lines(data, end)

    def finish(self) -> list[InputLine]:
        """The last line (one without a newline), and the errors of the file as a whole."""
        lines = self._lines(self._rest + b"\n", len(self._rest)) if self._rest and not self.done else []
        self._rest = b""
        if self.num_lines > MAX_LINES:
            self.errors.append(error_entry(None, "too_many_requests",
                                           f"A batch may have at most {MAX_LINES} requests."))
        elif not self.num_lines and not self.errors:
            self.errors.append(error_entry(None, "empty_file", "The input file has no requests."))
        return lines

    def _lines(self, data: bytes, end: int) -> list[InputLine]:
        valid: list[InputLine] = []
        start = 0
        while start <= end and not self.done:
            stop = data.find(b"\n", start, end + 1)
            raw = data[start:stop]
            start = stop + 1
            self._line_no += 1
            if not raw.strip():
                continue
            self.num_lines += 1
            if self.num_lines > MAX_LINES:
                break
            try:
                valid.append(self._line(raw))
            except LineError as exc:
                self.errors.append(error_entry(self._line_no, exc.code, exc.message, exc.param))
        return valid

    def _line(self, raw: bytes) -> InputLine:
        try:
            item = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError:
            raise LineError("invalid_json_line", "This line is not UTF-8 text.") from None
        except (ValueError, RecursionError):  # nesting deeper than the parser goes is a bad line too
            raise LineError("invalid_json_line", "This line is not valid JSON.") from None
        if not isinstance(item, dict):
            raise LineError("invalid_json_line", "This line is not a JSON object.")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            raise LineError("missing_required_parameter", "Each line needs a string `custom_id`.", "custom_id")
        if UNSTORABLE.search(custom_id):  # kept in a text column, and in the output file's lines
            raise LineError("invalid_value", f"The `custom_id` {describe(custom_id)}.", "custom_id")
        if custom_id in self._seen:
            raise LineError("duplicate_custom_id", f"The custom_id '{custom_id}' is used by an earlier line; each "
                            "must be unique.", "custom_id")
        self._seen.add(custom_id)
        if item.get("method") != "POST":
            raise LineError("invalid_method", "The `method` must be POST.", "method")
        if item.get("url") != self.endpoint:
            raise LineError("invalid_url", f"The `url` must be the batch's endpoint {self.endpoint}.", "url")
        body = item.get("body")
        if not isinstance(body, dict):
            raise LineError("invalid_request", "The `body` must be a JSON object.", "body")
        parsed = self._body(body)
        estimated = estimate_tokens(parsed.num_chars(), parsed.max_output_tokens, parsed.num_choices)
        self.estimated_tokens += estimated
        self.models.setdefault(parsed.model, self._line_no)
        return InputLine(self._line_no, custom_id, json.dumps(body), parsed.model, estimated)

    def _body(self, body: dict[str, Any]) -> ChatCompletionRequest | CompletionRequest:
        try:
            parsed = ENDPOINTS[self.endpoint].model_validate(body)
        except ValidationError as exc:
            raise LineError("invalid_request", *_describe(exc)) from None
        except RecursionError:
            raise LineError("invalid_request", "The `body` is nested too deeply.", "body") from None
        refusal = _not_in_a_batch(parsed)
        if refusal is not None:
            raise LineError("invalid_request", *refusal)
        try:
            check_bounds(parsed, self.limits)
        except OpenAIError as exc:
            raise LineError("invalid_request", exc.message, f"body.{exc.param}") from None
        return parsed


def parse_input(content: bytes, endpoint: str,
                limits: RequestLimits | None = None) -> tuple[list[InputLine], list[dict[str, Any]]]:
    """Validate a whole input file held in memory; returns the lines, or the errors with their line numbers."""
    parser = LineParser(endpoint, limits or RequestLimits())
    lines = parser.feed(content)
    lines += parser.finish()
    return ([], parser.errors) if parser.errors else (lines, [])
