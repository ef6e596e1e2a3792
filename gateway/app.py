"""The FastAPI application: routes, and the lifespan that owns the NATS connection, the Postgres pool and the
usage writer. Each route is thin; the work happens in ``CompletionService``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import asyncpg
import nats
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from gateway.errors import OpenAIError, install_error_handlers
from gateway.protocol import ChatCompletionRequest, CompletionRequest
from gateway.registry import ModelRegistry
from gateway.relay import Relay
from gateway.serving import CompletionService
from gateway.admin import admin_router
from gateway.usage_writer import run_usage_writer
from shared.config import SwitchyardConfig
from shared.jetstream import ensure_streams
from shared.tier_store import PolicyCache, read_policies, reconcile_queue_caps
from shared.tiers import TIER_NAMES

TIER_HEADER = "X-Switchyard-Tier"

log = logging.getLogger("switchyard.gateway")


async def _reconcile_caps(js, stop: asyncio.Event) -> None:
    """Lowered queue caps reach their target as queues drain (see shared.tier_store.apply_queue_cap)."""
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        try:
            await reconcile_queue_caps(js, await read_policies(js))
        except Exception as exc:  # NATS reconnecting: next round
            log.warning("queue cap reconcile failed: %s", exc)


def create_app(config: SwitchyardConfig) -> FastAPI:
    if not config.nats_url or not config.database_url:
        raise ValueError("the gateway needs nats_url and database_url (switchyard up starts both for you)")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        nc = await nats.connect(config.nats_url, name="switchyard-gateway", max_reconnect_attempts=-1)
        js = nc.jetstream()
        await ensure_streams(js)
        pool = await asyncpg.create_pool(config.database_url, min_size=1, max_size=4)
        registry = ModelRegistry(js)
        app.state.nc, app.state.js, app.state.pool, app.state.registry = nc, js, pool, registry
        app.state.policies = PolicyCache(js)
        app.state.service = CompletionService(
            Relay(nc, js, config.gateway.stall_timeout_s, config.gateway.retry_after_s), registry,
            app.state.policies, config.gateway,
        )
        stop = asyncio.Event()
        writer = asyncio.create_task(run_usage_writer(js, pool, stop), name="usage-writer")
        reconciler = asyncio.create_task(_reconcile_caps(js, stop), name="queue-caps")
        try:
            yield
        finally:
            stop.set()
            for task in (writer, reconciler):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(task, timeout=5)
            await pool.close()
            await nc.close()

    app = FastAPI(title="Switchyard", version="0.1.0", lifespan=lifespan)
    install_error_handlers(app)

    def request_tier(request: Request) -> str | None:
        tier = request.headers.get(TIER_HEADER)
        if tier is None or not config.gateway.allow_tier_header:
            return None
        if tier not in TIER_NAMES:
            raise OpenAIError(400, f"Unknown tier {tier!r}; known: {', '.join(TIER_NAMES)}.", code="invalid_tier",
                              param=TIER_HEADER)
        return tier

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await request.app.state.service.chat(body, request_tier(request))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        return await request.app.state.service.completion(body, request_tier(request))

    app.include_router(admin_router(config.gateway.admin_key))

    @app.get("/v1/models")
    async def list_models(request: Request):
        served = await request.app.state.registry.models(fresh=True)
        data = [
            {"id": name, "object": "model", "created": int(min(w.started_at for w in workers)),
             "owned_by": "switchyard", "max_model_len": max(w.max_context for w in workers)}
            for name, workers in sorted(served.items())
        ]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request):
        workers = (await request.app.state.registry.models(fresh=True)).get(model_id)
        if not workers:
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", code="model_not_found", param="model")
        return {"id": model_id, "object": "model", "created": int(min(w.started_at for w in workers)),
                "owned_by": "switchyard"}

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request):
        checks = {"nats": request.app.state.nc.is_connected}
        try:
            async with request.app.state.pool.acquire(timeout=2) as conn:
                await conn.fetchval("SELECT 1")
            checks["postgres"] = True
        except Exception:  # any failure means not ready; the reason belongs in the DB's own logs
            checks["postgres"] = False
        served = await request.app.state.registry.models()
        checks["models"] = sorted(served)
        ready = checks["nats"] and checks["postgres"]
        return JSONResponse({"ready": ready, "checks": checks, "time": time.time()}, status_code=200 if ready else 503)

    return app
