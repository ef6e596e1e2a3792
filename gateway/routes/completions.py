"""``POST /v1/chat/completions`` and ``POST /v1/completions``: read the body, admit it, serve it
(gateway/serving.py); a stream sent again with ``Last-Event-ID`` is resumed instead (gateway/stream_resume.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from switchyard.domain.api.bounds import check_bounds
from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.auth import AuthContext
from switchyard.gateway.admission import admit, answered, authenticated, bounded_body, request_ticket, schema_sizes
from switchyard.gateway.client_watch import until_gone
from switchyard.gateway.services import GatewayServices


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1")
    caller = authenticated(services)

    limits = services.config.gateway.limits

    @router.post("/chat/completions", dependencies=[Depends(bounded_body(limits, "chat"))])
    async def chat_completions(body: ChatCompletionRequest, request: Request, auth: AuthContext = Depends(caller)):
        check_bounds(body, limits, schema_sizes=schema_sizes(request))
        if body.stream and (last_event_id := request.headers.get("last-event-id")):
            return await services.completions.resume_chat(body, auth, last_event_id)
        ticket = await admit(services, request, request_ticket(auth, body))
        return await answered(services, ticket, services.completions.chat(body, ticket, gone=until_gone(request)))

    @router.post("/completions", dependencies=[Depends(bounded_body(limits, "completion"))])
    async def completions(body: CompletionRequest, request: Request, auth: AuthContext = Depends(caller)):
        check_bounds(body, limits)
        if body.stream and (last_event_id := request.headers.get("last-event-id")):
            return await services.completions.resume_completion(body, auth, last_event_id)
        ticket = await admit(services, request, request_ticket(auth, body))
        return await answered(services, ticket,
                              services.completions.completion(body, ticket, gone=until_gone(request)))

    return router
