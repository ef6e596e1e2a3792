"""The FastAPI application: routes, and the lifespan that owns the NATS connection and the Postgres pool (and, by
default, hosts the durable consumers of ``switchyard.jobs``). Each route is thin; the work happens in
``CompletionService``."""

from __future__ import annotations

import contextlib
import logging
import time

import asyncpg
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from switchyard.gateway.admin import admin_router
from switchyard.gateway.affinity import AffinityIndex
from switchyard.gateway.auth import AuthContext, Authenticator
from switchyard.gateway.batches import batches_router
from switchyard.gateway.body_limit import BodySizeLimit
from switchyard.gateway.conversations import conversations_router
from switchyard.gateway.database import POOL_OPTIONS, Database, DatabaseUnavailable, install_outage_handler
from switchyard.gateway.drain import CountInFlight, InFlightCounter
from switchyard.gateway.errors import OpenAIError, install_error_handlers
from switchyard.gateway.failover import Failover
from switchyard.gateway.files import files_router
from switchyard.gateway.limits import Admission, Limiter, estimate_tokens
from switchyard.gateway.liveness import WorkerLiveness
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.gateway.protocol import ChatCompletionRequest, CompletionRequest
from switchyard.gateway.queue_metrics import QueuePoller
from switchyard.gateway.registry import ModelRegistry
from switchyard.gateway.relay import Relay
from switchyard.gateway.request_ids import RequestIds
from switchyard.gateway.safety import InputSafety
from switchyard.gateway.routing import Router
from switchyard.gateway.serving import CompletionService
from switchyard.gateway.service_tiers import ServiceTier
from switchyard.gateway.service_tiers import choose as choose_service_tier
from switchyard.gateway.usage_report import usage_rows
from switchyard.jobs.runner import Jobs
from switchyard.shared import nats_client
from switchyard.shared.config import SwitchyardConfig
from switchyard.shared.jetstream import ensure_streams
from switchyard.shared.metrics import CONTENT_TYPE, render
from switchyard.shared.tier_store import PolicyCache
from switchyard.shared.tiers import TIER_NAMES
from switchyard.shared.tracing import tracer

TIER_HEADER = "X-Switchyard-Tier"

log = logging.getLogger("switchyard.gateway")


def create_app(config: SwitchyardConfig) -> FastAPI:
    if not config.nats_url or not config.database_url:
        raise ValueError("the gateway needs nats_url and database_url (switchyard up starts both for you)")

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        # First: a safety configuration that cannot work stops the start; the classifier is loaded once, here.
        app.state.safety = safety = InputSafety(config.gateway.safety, metrics)
        nc = await nats_client.connect(config.nats_url, "switchyard-gateway", tls_ca=config.nats_tls_ca)
        js = nc.jetstream()
        await ensure_streams(js, config.nats_replicas)
        pool = await asyncpg.create_pool(config.database_url, min_size=1, max_size=4, **POOL_OPTIONS)
        db = Database(pool)
        registry = ModelRegistry(js, {m.served_name: m.aliases for m in config.models})
        app.state.nc, app.state.js, app.state.pool, app.state.registry = nc, js, pool, registry
        app.state.policies = PolicyCache(js)
        app.state.db = db
        app.state.authenticator = Authenticator(db)
        app.state.router = Router(registry, config.gateway)
        app.state.limiter = Limiter(db, local_share=1 / config.gateway.num_gateways)
        liveness = WorkerLiveness()
        await liveness.start(nc)
        app.state.service = CompletionService(
            Relay(nc, js, config.gateway.stall_timeout_s, config.gateway.retry_after_s, liveness,
                  Failover(js, registry, liveness)), registry,
            app.state.policies, app.state.limiter, config.gateway, metrics, safety=safety,
            affinity=AffinityIndex(js, config.nats_replicas) if config.gateway.affinity else None,
        )
        poller = QueuePoller(metrics, js, registry, db)
        poller.start()
        jobs = Jobs(nc, js, pool, registry, config.database_url, safety) if config.gateway.run_jobs else None
        try:
            yield
        finally:
            await poller.stop()
            if jobs is not None:
                await jobs.stop()
            await pool.close()
            await nc.close()

    # FastAPI's own OpenTelemetry server span is each API request's root span (a stream's until its last chunk);
    # it records nothing until shared/tracing.py installs a provider. Only /v1 is traced (not probes or scrapes),
    # its metrics are Prometheus's here, and its logs are off: they would carry request bodies.
    telemetry = {"exclude": lambda scope: not scope.get("path", "").startswith("/v1/"), "operation_spans": False,
                 "metrics": False, "logs": False}
    app = FastAPI(title="Switchyard", version="0.1.0", lifespan=lifespan, telemetry=telemetry)
    app.state.metrics = metrics = GatewayMetrics()
    install_error_handlers(app)
    install_outage_handler(app)
    app.add_middleware(BodySizeLimit, max_bytes=config.gateway.max_request_bytes)
    app.state.in_flight = InFlightCounter()
    app.state.draining = False  # set by DrainingServer on SIGTERM
    app.add_middleware(CountInFlight, counter=app.state.in_flight)

    def request_tier(request: Request) -> str | None:
        tier = request.headers.get(TIER_HEADER)
        if tier is None or not config.gateway.allow_tier_header:
            return None
        if tier not in TIER_NAMES:
            raise OpenAIError(400, f"Unknown tier {tier!r}; known: {', '.join(TIER_NAMES)}.", code="invalid_tier",
                              param=TIER_HEADER)
        return tier

    async def caller(request: Request) -> AuthContext:
        """Every /v1 route depends on this, so a bad key is 401 before the body is even validated."""
        with tracer.start_as_current_span("authenticate"):
            auth = await request.app.state.authenticator.authenticate(request)
        request.state.auth = auth
        return auth

    async def admit(request: Request, auth: AuthContext, model: str, max_tokens: int | None, num_chars: int,
                    n: int = 1, service_tier: str | None = None, text: str = "",
                    ) -> tuple[str, ServiceTier, Admission]:
        """The tier and the model (an alias or ``auto`` resolved, gateway/routing.py) that serve the request, and
        its admission under the key's limits. ``text``: what routing by difficulty reads."""
        service = choose_service_tier(service_tier, auth, request_tier(request))
        request.state.tier = service.tier  # for the error metrics' labels
        model = await request.app.state.router.resolve(model, service.tier, num_chars, max_tokens, text)
        request.state.model = model
        policy = (await request.app.state.policies.get())[service.tier]
        with tracer.start_as_current_span("rate_limits", attributes={"tier": service.tier}):
            admission = await request.app.state.limiter.admit(auth, policy, estimate_tokens(num_chars, max_tokens, n))
        request.state.rate_headers = admission.headers
        return model, service, admission

    @app.middleware("http")
    async def rate_limit_headers(request: Request, call_next):
        response = await call_next(request)
        for name, value in getattr(request.state, "rate_headers", {}).items():
            response.headers.setdefault(name, value)
        return response

    # Outermost, added last (outside rate_limit_headers too, which runs the app in a task of its own and sends the
    # response from this one): everything below, and uvicorn's access line, carry the request id.
    app.add_middleware(RequestIds)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request, auth: AuthContext = Depends(caller)):
        request.state.model = body.model
        max_tokens = body.max_completion_tokens or body.max_tokens
        model, service, admission = await admit(request, auth, body.model, max_tokens, body.num_chars(), body.n,
                                                body.service_tier, body.routing_text())
        return await request.app.state.service.chat(body.model_copy(update={"model": model}), service, auth, admission)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request, auth: AuthContext = Depends(caller)):
        request.state.model = body.model
        model, service, admission = await admit(request, auth, body.model, body.sampling().max_tokens,
                                                body.num_chars(), body.num_generated * len(body.prompts),
                                                text=body.routing_text())
        return await request.app.state.service.completion(body.model_copy(update={"model": model}), service, auth,
                                                          admission)

    app.include_router(admin_router(config.gateway.admin_key))
    app.include_router(conversations_router(caller, admit))
    app.include_router(files_router(caller))
    app.include_router(batches_router(caller))

    @app.get("/v1/models")
    async def list_models(request: Request, _: AuthContext = Depends(caller)):
        registry = request.app.state.registry
        served = await registry.models(fresh=True)
        data = [
            {"id": name, "object": "model", "created": int(min(w.started_at for w in workers)),
             "owned_by": "switchyard", "max_model_len": max(w.max_context for w in workers),
             "aliases": registry.aliases(name)}
            for name, workers in sorted(served.items())
        ]
        # The routing names ("auto"), listed while a model they route to is live.
        routed = {rule.model for rule in config.gateway.routes}
        if any([await registry.resolve(m) in served for m in routed]):
            data += [{"id": name, "object": "model", "created": 0, "owned_by": "switchyard",
                      "routes_to": sorted(routed)} for name in sorted(request.app.state.router.route_names)]
        return {"object": "list", "data": data}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str, request: Request, _: AuthContext = Depends(caller)):
        workers = (await request.app.state.registry.models(fresh=True)).get(model_id)
        if not workers:
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", code="model_not_found", param="model")
        return {"id": model_id, "object": "model", "created": int(min(w.started_at for w in workers)),
                "owned_by": "switchyard"}

    @app.get("/v1/usage")
    async def usage(request: Request, start: str | None = None, end: str | None = None, group_by: str = "model",
                    auth: AuthContext = Depends(caller)):
        async with request.app.state.pool.acquire() as conn:
            rows = await usage_rows(conn, auth.tenant_id, start, end, group_by)
        return {"object": "list", "tenant": auth.tenant_name, "group_by": group_by, "data": rows}

    @app.get("/metrics", include_in_schema=False)
    async def prometheus_metrics():
        return Response(render(metrics.registry), media_type=CONTENT_TYPE)

    @app.get("/healthz")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request):
        checks = {"nats": request.app.state.nc.is_connected}
        try:
            await request.app.state.db.run(lambda pool: pool.fetchval("SELECT 1"))
            checks["postgres"] = True
        except DatabaseUnavailable:
            checks["postgres"] = False
        try:
            checks["models"] = sorted(await request.app.state.registry.models())
        except OpenAIError:  # NATS unreachable: already not ready
            checks["models"] = []
        checks["draining"] = request.app.state.draining
        # Postgres away degrades the gateway (known keys served, limits local) but does not stop it: a load
        # balancer pulling every gateway out for it would turn a degradation into an outage.
        ready = checks["nats"] and not checks["draining"]
        return JSONResponse({"ready": ready, "degraded": not checks["postgres"], "checks": checks,
                             "time": time.time()}, status_code=200 if ready else 503)

    return app
