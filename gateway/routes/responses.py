"""``/v1/responses``: OpenAI's Responses API over the chat path (gateway/responses_service.py), stored per tenant
(domain/responses.py).

    POST   /v1/responses                          {model, input, instructions?, tools?, stream?, background?, ...}
    GET    /v1/responses/{id}                     ?stream=true&starting_after=N: a streamed response's stream, resumed
                                                  on any gateway after its own died (gateway/responses_service.py)
    DELETE /v1/responses/{id}
    GET    /v1/responses/{id}/input_items         ?limit=&after=&order=asc|desc
    POST   /v1/responses/{id}/cancel              a background response

The earlier turns (``previous_response_id``, ``conversation``) count toward the request's size, its bounds (input
items as messages, domain/api/bounds.py) and token reservation like a conversation's history; only the new input
and the instructions are judged by the input filter.
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Query, Request

from switchyard.domain.api.bounds import check_response_bounds
from switchyard.domain.api.responses import ResponseCreate
from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.gateway.admission import (
    admit,
    answered,
    authenticated,
    bounded_body,
    counted,
    request_ticket,
    schema_sizes,
)
from switchyard.gateway.services import GatewayServices


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1/responses")
    caller = authenticated(services)
    call = counted(services)  # reading, deleting, cancelling a stored response counts against the key's rate too

    limits = services.config.gateway.limits

    @router.post("", dependencies=[Depends(bounded_body(limits, "response"))])
    async def create(body: ResponseCreate, request: Request, auth: AuthContext = Depends(caller)):
        context = await services.responses.context(body, auth.tenant_id)
        check_response_bounds(body, limits, num_history=len(context.history), schema_sizes=schema_sizes(request))
        model = body.model or context.model
        if not model:
            raise OpenAIError(400, "Missing required parameter: 'model'.", param="model",
                              code="missing_required_parameter")
        ticket = await admit(services, request, request_ticket(
            auth, body, model=model, num_chars=body.num_chars() + context.num_chars()))
        return await answered(services, ticket, services.responses.create(body, ticket, context))

    @router.get("/{response_id}")
    async def get(response_id: str, stream: bool = False, starting_after: int | None = Query(None, ge=0),
                  include_obfuscation: bool = False, auth: AuthContext = Depends(call)):
        if include_obfuscation:
            raise OpenAIError(400, "Stream obfuscation is not supported: leave include_obfuscation unset or false.",
                              param="include_obfuscation", code="unsupported_parameter")
        if stream:
            return await services.responses.resume(response_id, auth.tenant_id, starting_after)
        if starting_after is not None:
            raise OpenAIError(400, "'starting_after' applies to a stream: ask with stream=true.",
                              param="starting_after", code="invalid_request")
        return await services.response_store.get(response_id, auth.tenant_id)

    @router.delete("/{response_id}")
    async def delete(response_id: str, auth: AuthContext = Depends(call)):
        await services.response_store.delete(response_id, auth.tenant_id)
        return {"id": response_id, "object": "response.deleted", "deleted": True}

    @router.get("/{response_id}/input_items")
    async def input_items(response_id: str, limit: int = 20, after: str | None = None,
                          order: Literal["asc", "desc"] = "desc", auth: AuthContext = Depends(call)):
        return await services.response_store.input_items(response_id, auth.tenant_id, limit, after, order)

    @router.post("/{response_id}/cancel")
    async def cancel(response_id: str, auth: AuthContext = Depends(call)):
        return await services.responses.cancel(response_id, auth.tenant_id)

    return router
