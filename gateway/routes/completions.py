"""``POST /v1/chat/completions`` and ``POST /v1/completions``: read the body, admit it, serve it
(gateway/serving.py); a stream sent again with ``Last-Event-ID`` is resumed instead (gateway/stream_resume.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from switchyard.domain.api.bounds import check_bounds, check_raw_bounds
from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.auth import AuthContext
from switchyard.gateway.admission import admit, authenticated, request_ticket
from switchyard.gateway.client_watch import until_gone
from switchyard.gateway.services import GatewayServices


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1")
    caller = authenticated(services)

    limits = services.config.gateway.limits

    def bounded(chat: bool):
        """A dependency: the body's bounds, read off its JSON before FastAPI validates it into the model (it
        solves dependencies first): a body far over them costs the event loop its decoding, not its validation."""

        async def check(request: Request) -> None:
            try:
                decoded = await request.json()  # decoded already, and kept, by FastAPI
            except ValueError:
                return  # not JSON: validation says so
            check_raw_bounds(decoded, limits, chat)

        return check

    @router.post("/chat/completions", dependencies=[Depends(bounded(chat=True))])
    async def chat_completions(body: ChatCompletionRequest, request: Request, auth: AuthContext = Depends(caller)):
        check_bounds(body, limits)
        if body.stream and (last_event_id := request.headers.get("last-event-id")):
            return await services.completions.resume_chat(body, auth, last_event_id)
        ticket = await admit(services, request, request_ticket(auth, body))
        return await services.completions.chat(body, ticket, gone=until_gone(request))

    @router.post("/completions", dependencies=[Depends(bounded(chat=False))])
    async def completions(body: CompletionRequest, request: Request, auth: AuthContext = Depends(caller)):
        check_bounds(body, limits)
        if body.stream and (last_event_id := request.headers.get("last-event-id")):
            return await services.completions.resume_completion(body, auth, last_event_id)
        ticket = await admit(services, request, request_ticket(auth, body))
        return await services.completions.completion(body, ticket, gone=until_gone(request))

    return router
