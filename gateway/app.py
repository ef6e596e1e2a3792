"""The FastAPI application: middleware, error handlers and the routes (gateway/routes/), over the gateway's named
services (gateway/services.py), which its lifespan starts and stops.

    request ─▶ RequestIds ─▶ rate-limit headers ─▶ in-flight count ─▶ body size limit ─▶ route ─▶ services
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI

from switchyard.gateway.body_limit import BodySizeLimit
from switchyard.gateway.drain import CountInFlight
from switchyard.gateway.rate_headers import RateLimitHeaders
from switchyard.gateway.errors import install_error_handlers
from switchyard.gateway.request_ids import RequestIds
from switchyard.gateway.routes import all_routers
from switchyard.gateway.services import GatewayServices
from switchyard.shared.config import SwitchyardConfig

# Something that runs beside the gateway for as long as it serves (``switchyard gateway`` puts the durable
# consumers here unless --no-jobs): entered once the services started, left before they stop.
Companion = Callable[[], AbstractAsyncContextManager]


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
    telemetry = {"exclude": lambda scope: not scope.get("path", "").startswith("/v1/"), "operation_spans": False,
                 "metrics": False, "logs": False}
    app = FastAPI(title="Switchyard", version="0.1.0", lifespan=lifespan, telemetry=telemetry)
    install_error_handlers(app, services.metrics)
    app.add_middleware(BodySizeLimit, max_bytes=config.gateway.max_request_bytes)
    app.add_middleware(CountInFlight, counter=services.in_flight)

    app.add_middleware(RateLimitHeaders)
    # Outermost, added last: everything below, and uvicorn's access line, carry the request id.
    app.add_middleware(RequestIds)
    for router in all_routers(services):
        app.include_router(router)
    return app
