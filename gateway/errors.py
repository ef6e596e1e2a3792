"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Handlers turn request validation failures into 400 (never a 422 with a pydantic dump), pass our own
``OpenAIError`` through, and log anything else with the request path before answering a generic 500.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from switchyard.shared.messages import ErrorInfo

log = logging.getLogger("switchyard.gateway")


class OpenAIError(Exception):
    """An error the client should see as-is."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    @classmethod
    def from_info(cls, info: ErrorInfo, headers: dict[str, str] | None = None) -> "OpenAIError":
        return cls(info.status, info.message, type=info.type, code=info.code, param=info.param, headers=headers)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model `{model}` does not exist or no worker serves it.",
        code="model_not_found",
        param="model",
    )


def service_unavailable(message: str, retry_after_s: int, code: str = "service_unavailable") -> OpenAIError:
    return OpenAIError(
        503, message, type="service_unavailable", code=code, headers={"Retry-After": str(retry_after_s)}
    )


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None, str]:
    """One readable sentence, the offending parameter and the error code, from pydantic's first error."""
    errors = exc.errors()
    if not errors:
        return "Invalid request body.", None, "invalid_request"
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    kind = first.get("type")
    if kind == "json_invalid":
        return "We could not parse the JSON body of your request.", None, "invalid_request"
    if kind == "unsupported_parameter":  # protocol.unsupported: a parameter refused by name
        ctx = first.get("ctx") or {}
        return ctx.get("why", first.get("msg", "")), ctx.get("param", param), "unsupported_parameter"
    if kind == "extra_forbidden":  # OpenAI's own words for a parameter it does not have
        return f"Unrecognized request argument supplied: {param}", param, "unsupported_parameter"
    msg = first.get("msg", "invalid value")
    if kind == "missing":
        return f"Missing required parameter: '{param}'.", param, "invalid_request"
    return (f"Invalid value for '{param}': {msg}." if param else f"Invalid request body: {msg}."), param, \
        "invalid_request"


_STATUS_CODES = {401: "invalid_api_key", 404: "not_found", 405: "method_not_allowed"}


def answer(request: Request, error: OpenAIError) -> JSONResponse:
    """``error`` as the response to ``request``, counted in the gateway's error metrics (by status and code, with
    the model and tier the route put on ``request.state`` once it knew them)."""
    metrics = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        metrics.error(getattr(request.state, "model", None), getattr(request.state, "tier", None), error.status,
                      error.code)
    return error.response()


def install_error_handlers(app: FastAPI) -> None:
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

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s %s", request.method, request.url.path)
        return answer(request, OpenAIError(500, "The server had an error processing your request.",
                                           type="server_error", code="internal_error"))
