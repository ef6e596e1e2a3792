"""``GET /v1/usage``: the caller's tenant's usage and cost, grouped by model or day (domain/usage_report.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends

from switchyard.domain.auth import AuthContext
from switchyard.gateway.admission import counted
from switchyard.gateway.services import GatewayServices


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1")
    caller = counted(services)  # every call counts against its key's request rate

    @router.get("/usage")
    async def usage(start: str | None = None, end: str | None = None, group_by: str = "model",
                    auth: AuthContext = Depends(caller)):
        rows = await services.usage.rows(auth.tenant_id, start, end, group_by)
        return {"object": "list", "tenant": auth.tenant_name, "group_by": group_by, "data": rows}

    return router
