"""Every ``/v1`` answer names its request in ``X-Request-Id``, an error's too (gateway/errors.py), as OpenAI's do: it
is the id the request is billed and logged under (gateway/request_ids.py)."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from switchyard.domain.errors import OpenAIError
from switchyard.gateway.errors import install_error_handlers
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.request_ids import RequestIds, current_request_id


def _app() -> FastAPI:
    app = FastAPI()
    install_error_handlers(app, GatewayMetrics())

    @app.get("/v1/fails")
    async def fails() -> None:
        raise OpenAIError(503, f"lost {current_request_id()}", type="server_error", code="worker_lost",
                          headers={"Retry-After": "1"})

    @app.get("/fails")
    async def fails_outside_the_api() -> None:
        raise OpenAIError(503, "lost", code="worker_lost")

    app.add_middleware(RequestIds)
    return app


async def test_an_error_answer_names_the_request_it_was_served_as():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://gw") as http:
        failed = await http.get("/v1/fails")
        assert failed.status_code == 503 and failed.headers["retry-after"] == "1"
        assert failed.json()["error"]["message"] == f"lost {failed.headers['x-request-id']}"
        again = await http.get("/v1/fails")
        assert again.headers["x-request-id"] != failed.headers["x-request-id"]  # one id per request
        assert "x-request-id" not in (await http.get("/fails")).headers  # not an API request: no id
