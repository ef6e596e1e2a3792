"""Probes and scrapes: ``GET /healthz`` (alive), ``GET /readyz`` (send traffic here?), ``GET /metrics``."""

from __future__ import annotations

import os
import time

from fastapi import APIRouter
from fastapi.responses import JSONResponse, Response

from switchyard.domain.database import ping
from switchyard.domain.errors import OpenAIError
from switchyard.gateway.services import GatewayServices
from switchyard.shared.metrics import CONTENT_TYPE, render


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter()

    @router.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        return Response(render(services.metrics.registry), media_type=CONTENT_TYPE)

    @router.get("/healthz")
    async def healthz():
        # The process: several gateway processes may share one port (``gateway.processes``).
        return {"status": "ok", "process": os.getpid()}

    @router.get("/readyz")
    async def readyz():
        checks: dict[str, bool | list[str]] = {"nats": services.nc.is_connected, "postgres": await ping(services.db)}
        try:
            listing = await services.registry.models()
        except OpenAIError:  # NATS unreachable: already not ready
            listing = {}
        checks["models"] = sorted(listing)
        # The models this gateway sends long prompts apart for: it sees a live prefill worker of each, not draining.
        checks["prefill_pools"] = sorted(m for m, workers in listing.items()
                                         if any(w.takes_prefills for w in workers))
        checks["draining"] = services.draining
        # Postgres away degrades the gateway (known keys served, limits local) but does not stop it: a load
        # balancer pulling every gateway out for it would turn a degradation into an outage.
        ready = checks["nats"] and not checks["draining"]
        return JSONResponse({"ready": ready, "degraded": not checks["postgres"], "checks": checks,
                             "time": time.time()}, status_code=200 if ready else 503)

    return router
