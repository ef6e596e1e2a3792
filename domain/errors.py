"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the status they are answered with.

Raised anywhere below the HTTP edge (admission policies, stores, publishing) and answered by the gateway's handlers
(gateway/errors.py); the batch runner turns one into a failed line (``info()``).
"""

from __future__ import annotations

from typing import Any

from switchyard.shared.messages import ErrorInfo


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
    def from_info(cls, info: ErrorInfo, headers: dict[str, str] | None = None) -> OpenAIError:
        return cls(info.status, info.message, type=info.type, code=info.code, param=info.param, headers=headers)

    def info(self) -> ErrorInfo:
        """The error as the wire and the batch results carry it."""
        return ErrorInfo(self.message, code=self.code or "", type=self.type, param=self.param, status=self.status)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


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
