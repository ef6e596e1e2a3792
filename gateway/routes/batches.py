"""``/v1/batches``: the OpenAI Batch API, per tenant (domain/batches.py). The routes only record intent; the jobs'
batch runner validates, runs, cancels and finalizes (jobs/batch_runner.py).

    POST /v1/batches                {input_file_id, endpoint, completion_window: "24h", metadata?} → Batch
    GET  /v1/batches                ?after=&limit=                                                 → list
    GET  /v1/batches/{id}                                                                          → Batch
    POST /v1/batches/{id}/cancel                                                                   → Batch
"""

from __future__ import annotations

from fastapi import APIRouter, Depends
from pydantic import BaseModel, ConfigDict, Field, model_validator

from switchyard.domain.api.text import StoredText, check_encodable
from switchyard.domain.auth import AuthContext
from switchyard.gateway.admission import counted
from switchyard.gateway.services import GatewayServices


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. output_expires_after: accepted, not applied

    input_file_id: StoredText = Field(min_length=1)
    endpoint: StoredText
    completion_window: StoredText
    metadata: dict[StoredText, StoredText] | None = Field(None, max_length=16)

    _encodable = model_validator(mode="before")(check_encodable)


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1/batches")
    caller = counted(services)  # every call counts against its key's request rate

    @router.post("")
    async def create(body: BatchCreate, auth: AuthContext = Depends(caller)):
        return await services.batches.create(auth, body.input_file_id, body.endpoint, body.completion_window,
                                             body.metadata)

    @router.get("")
    async def list_batches(limit: int = 20, after: str | None = None, auth: AuthContext = Depends(caller)):
        return await services.batches.list(auth.tenant_id, limit, after)

    @router.get("/{batch_id}")
    async def retrieve(batch_id: str, auth: AuthContext = Depends(caller)):
        return await services.batches.get(batch_id, auth.tenant_id)

    @router.post("/{batch_id}/cancel")
    async def cancel(batch_id: str, auth: AuthContext = Depends(caller)):
        return await services.batches.cancel(batch_id, auth.tenant_id)

    return router
