"""``POST /v1/embeddings``: read the body, admit it, embed it (gateway/embeddings.py) on the model's own workers."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from switchyard.domain.api.embeddings import EmbeddingRequest
from switchyard.domain.auth import AuthContext
from switchyard.gateway.admission import admit, answered, authenticated, request_ticket
from switchyard.gateway.services import GatewayServices


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1")
    caller = authenticated(services)

    @router.post("/embeddings")
    async def embeddings(body: EmbeddingRequest, request: Request, auth: AuthContext = Depends(caller)):
        ticket = await admit(services, request, request_ticket(auth, body))
        return await answered(services, ticket, services.embeddings.embed(body, ticket))

    return router
