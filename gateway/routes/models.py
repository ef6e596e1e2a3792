"""``GET /v1/models`` and ``GET /v1/models/{id}``: the live models (from the workers' heartbeats, domain/registry.py)
with their context length and aliases, and the routing names (``auto``) while a model they route to is live."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.gateway.admission import authenticated
from switchyard.gateway.services import GatewayServices


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1/models")
    caller = authenticated(services)

    @router.get("")
    async def list_models(_: AuthContext = Depends(caller)):
        registry = services.registry
        served = await registry.models(fresh=True)
        data = [
            {"id": name, "object": "model", "created": int(min(w.started_at for w in workers)),
             "owned_by": "switchyard", "max_model_len": max(w.max_context for w in workers),
             "aliases": registry.aliases(name), **_engine_of(workers)}
            for name, workers in sorted(served.items())
        ]
        routed = {rule.model for rule in services.config.gateway.routes}
        if any([await registry.resolve(m) in served for m in routed]):
            data += [{"id": name, "object": "model", "created": 0, "owned_by": "switchyard",
                      "routes_to": sorted(routed)} for name in sorted(services.router.route_names)]
        return {"object": "list", "data": data}

    @router.get("/{model_id:path}")
    async def get_model(model_id: str, _: AuthContext = Depends(caller)):
        workers = (await services.registry.models(fresh=True)).get(model_id)
        if not workers:
            raise OpenAIError(404, f"The model `{model_id}` does not exist.", code="model_not_found", param="model")
        return {"id": model_id, "object": "model", "created": int(min(w.started_at for w in workers)),
                "owned_by": "switchyard", **_engine_of(workers)}

    return router


def _engine_of(workers: list) -> dict:
    """The engines serving a model, and whether any is a test double (said wherever a simulated one serves)."""
    engines = sorted({w.engine for w in workers if w.engine})
    return {"engine": ",".join(engines), "test_double": any(w.test_double for w in workers)}
