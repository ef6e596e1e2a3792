"""Every ``/v1`` answer names its request in ``X-Request-Id`` (gateway/request_ids.py), an error's too, as OpenAI's
do: it is the id the request is billed and logged under. An answer that already names it keeps its own."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from switchyard.gateway.request_ids import RequestIds, current_request_id


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/v1/fails")
    async def fails() -> JSONResponse:
        return JSONResponse({"error": {"code": "worker_lost", "id": current_request_id()}}, status_code=503)

    @app.get("/v1/named")
    async def named() -> JSONResponse:
        return JSONResponse({}, headers={"X-Request-Id": "its-own"})

    @app.get("/health")
    async def health() -> JSONResponse:
        return JSONResponse({})

    app.add_middleware(RequestIds)
    return app


async def test_an_error_answer_names_the_request_it_was_served_as_and_a_named_answer_keeps_its_name():
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=_app()), base_url="http://gw") as http:
        failed = await http.get("/v1/fails")
        assert failed.status_code == 503
        assert failed.headers["x-request-id"] == failed.json()["error"]["id"]
        again = await http.get("/v1/fails")
        assert again.headers["x-request-id"] != failed.headers["x-request-id"]  # one id per request
        named = await http.get("/v1/named")
        assert named.headers.get_list("x-request-id") == ["its-own"]
        assert "x-request-id" not in (await http.get("/health")).headers  # not an API request
