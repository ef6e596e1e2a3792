"""How errors are answered over HTTP: OpenAI-shaped, ``{"error": {"message", "type", "param", "code"}}``.

Handlers turn request validation failures into 400 (never a 422 with a pydantic dump), pass our own
``OpenAIError`` (domain/errors.py) through, answer a Postgres outage met outside ``Database.run`` with 503 and
Retry-After, and log anything else with the request path before answering a generic 500.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from switchyard.domain.api.text import field_path
from switchyard.domain.database import OUTAGE_ERRORS, DatabaseUnavailable, database_unavailable
from switchyard.domain.errors import OpenAIError
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.request_ids import served_request_id

log = logging.getLogger("switchyard.gateway")


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """One readable sentence, the offending parameter and the error code, from pydantic's first error."""
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None, "invalid_request"
    first = errors[0]
    param = ".".join(p for p in field_path(first) if p != "body") or None
    kind = first.get("type")
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request.", None, "invalid_request"
    if kind == "unsupported_parameter":  # protocol.unsupported: a parameter refused by name
        ctx = first.get("ctx") or {}
        return ctx.get("why", first.get("msg", "")), ctx.get("param", param), "unsupported_parameter"
    if kind == "invalid_text":  # api/text.py: a string NATS or Postgres cannot take
        return f"Invalid value for '{param}': {(first.get('ctx') or {}).get('why')}.", param, "invalid_value"
    if kind == "extra_forbidden":  # OpenAI's own words for a parameter it does not have
        return f"Unrecognized request argument supplied: {param}", param, "unsupported_parameter"
    msg = first.get("msg", "invalid value")
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param, "invalid_request"
    return (f"Invalid value for '{param}': {msg}." if param else f"Invalid request body: {msg}."), param, \
        "invalid_request"


_STATUS_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}


def install_error_handlers(app: FastAPI, metrics: GatewayMetrics) -> None:
    """Every error answered OpenAI-shaped and counted in ``metrics`` (by status and code, with the model and tier
    the route put on ``request.state`` once it knew them)."""

    def answer(request: Request, error: OpenAIError) -> JSONResponse:
        metrics.error(getattr(request.state, "model", None), getattr(request.state, "tier", None), error.status,
                      error.code)
        headers = dict(error.headers)
        # An error names its request, as a success does (and OpenAI's errors do): a client reports it, and finds
        # what was billed for a request that failed after it ran.
        if (request_id := served_request_id()) is not None:
            headers.setdefault("X-Request-Id", request_id)
        return JSONResponse(error.body(), status_code=error.status, headers=headers)

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return answer(request, exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param, code = _describe_validation(exc)
        return answer(request, OpenAIError(400, message, param=param, code=code))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _STATUS_CODES.get(exc.status_code)
        return answer(request, OpenAIError(exc.status_code, str(exc.detail), code=code))

    async def _outage(request: Request, exc: Exception) -> JSONResponse:
        # A Postgres outage met outside ``Database.run`` (a store querying its pool directly): 503 with
        # Retry-After, never a 500 or a hang.
        log.warning("%s %s: Postgres unavailable (%r)", request.method, request.url.path, exc)
        return answer(request, database_unavailable())

    for error in (DatabaseUnavailable, ConnectionError, asyncio.TimeoutError, *OUTAGE_ERRORS[2:]):  # not all OSError
        app.add_exception_handler(error, _outage)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return answer(request, OpenAIError(500, "The server had an error processing your request.",
                                           type="server_error", code="internal_error"))
