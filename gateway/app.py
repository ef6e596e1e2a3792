"""The FastAPI application: middleware, error handlers and the routes (gateway/routes/), over the gateway's named
services (gateway/services.py), which its lifespan starts and stops.

    request ─▶ RequestIds ─▶ rate-limit headers ─▶ in-flight count ─▶ URL text ─▶ key checked (gatekeeper)
            ─▶ body size and pace ─▶ route ─▶ services

A streamed response's chunks skip the middlewares' ``send`` wrappers (gateway/client_watch.py says why): its
start line and end pass them, and none of them rewrites a body.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI
from fastapi.telemetry import TelemetryConfig

from switchyard.gateway.body_limit import BodySizeLimit
from switchyard.gateway.client_watch import passing_stream_starts
from switchyard.gateway.drain import CountInFlight
from switchyard.gateway.errors import install_error_handlers
from switchyard.gateway.gatekeeper import Gatekeeper
from switchyard.gateway.identity import GatewayIdentity
from switchyard.gateway.rate_headers import RateLimitHeaders
from switchyard.gateway.refused_bodies import RefusedBodies
from switchyard.gateway.request_ids import RequestIds
from switchyard.gateway.routes import all_routers
from switchyard.gateway.services import GatewayServices
from switchyard.gateway.url_text import UrlText
from switchyard.shared.config import SwitchyardConfig

# Something that runs beside the gateway for as long as it serves (``switchyard gateway`` puts the durable
# consumers here unless --no-jobs): entered once the services started, left before they stop.
Companion = Callable[[], AbstractAsyncContextManager]


class GatewayApp(FastAPI):
    """FastAPI, with the outermost layer that lets a stream's chunks go straight to the server
    (client_watch.passing_stream_starts)."""

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            send = passing_stream_starts(scope, send)
        await super().__call__(scope, receive, send)


def create_app(config: SwitchyardConfig, services: GatewayServices | None = None,
               companions: Sequence[Companion] = ()) -> FastAPI:
    """The gateway's app. ``services``: default, made from ``config`` (started by the app's lifespan)."""
    services = services or GatewayServices(config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await services.start()
        try:
            async with contextlib.AsyncExitStack() as beside:
                for companion in companions:
                    await beside.enter_async_context(companion())
                yield
        finally:
            await services.stop()

    # FastAPI's own OpenTelemetry server span is each API request's root span (a stream's until its last chunk);
    # it records nothing until shared/tracing.py installs a provider. Only /v1 is traced (not probes or scrapes),
    # its metrics are Prometheus's here, and its logs are off: they would carry request bodies.
    telemetry: TelemetryConfig = {"exclude": lambda scope: not scope.get("path", "").startswith("/v1/"),
                                  "operation_spans": False, "metrics": False, "logs": False}
    app = GatewayApp(title="Switchyard", version="0.1.0", lifespan=lifespan, telemetry=telemetry)
    install_error_handlers(app, services.metrics)
    gateway = config.gateway
    app.add_middleware(BodySizeLimit, max_bytes=gateway.max_request_bytes, timeout_s=gateway.body_timeout_s,
                       upload_timeout_s=gateway.upload_timeout_s)
    app.add_middleware(RefusedBodies, per_minute=gateway.refused_body_bytes_per_minute, metrics=services.metrics)
    app.add_middleware(Gatekeeper, services=services, per_minute=gateway.failed_auth_per_minute,
                       trusted_proxies=gateway.trusted_proxies)  # the key, before the body is read
    app.add_middleware(UrlText)
    app.add_middleware(CountInFlight, counter=services.in_flight)

    app.add_middleware(RateLimitHeaders)
    app.add_middleware(GatewayIdentity)  # every response, errors of the middlewares below included
    # Outermost, added last: everything below, and uvicorn's access line, carry the request id.
    app.add_middleware(RequestIds)
    for router in all_routers(services):
        app.include_router(router)
    return app
