"""``/v1/conversations``: conversations kept on the server (domain/conversations.py), and a new turn answered like
a chat completion over the stored history.

    POST   /v1/conversations                  {model?, system?, metadata?}
    GET    /v1/conversations/{id}
    GET    /v1/conversations/{id}/messages    ?limit=&after=&order=asc|desc
    POST   /v1/conversations/{id}/messages    {content, model?, stream?, max_tokens?, ...}: the reply, like chat
    DELETE /v1/conversations/{id}

A turn sends the newest stored messages (``gateway.limits.max_history_messages`` and ``max_history_chars``, the
system prompt always); the worker drops the oldest of them over the context, and the reply says how many were
left out in all (``dropped_messages``); only
the new message is judged by the input filter (the history was when it was new; the system prompt when the
conversation was created).
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from switchyard.domain.api.bounds import check_bounds
from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.fields import unsupported
from switchyard.domain.api.text import StoredText, check_encodable
from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.gateway.admission import admit, admit_call, answered, authenticated, counted, request_ticket
from switchyard.gateway.client_watch import until_gone
from switchyard.gateway.services import GatewayServices
from switchyard.gateway.serving import Outcome
from switchyard.shared.messages import ChatMessage, ConversationTurn


class ConversationCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StoredText | None = None
    system: StoredText | None = None
    metadata: dict[StoredText, StoredText] = Field(default_factory=dict, max_length=16)

    _encodable = model_validator(mode="before")(check_encodable)


class TurnRequest(ChatCompletionRequest):
    """A chat completion whose history is the conversation's: ``content`` is the new message, the user's, or a
    tool's result (``role`` tool with the ``tool_call_id`` it answers)."""

    model: StoredText | None = None  # type: ignore[assignment]  # optional here: the conversation's model
    content: StoredText = Field(min_length=1)  # stored with the conversation: no U+0000
    role: Literal["user", "tool"] = "user"
    tool_call_id: StoredText | None = None
    messages: list = Field(default_factory=list, exclude=True)  # not accepted here: the server has the history

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> TurnRequest:
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        if self.messages:
            raise unsupported("messages", "A conversation's history is on the server: send only the new message, "
                                          "as content.")
        return self


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1/conversations")
    caller = authenticated(services)
    call = counted(services)  # what generates nothing counts against the key's request rate too

    @router.post("")
    async def create(body: ConversationCreate, request: Request, auth: AuthContext = Depends(caller)):
        # The system prompt is judged here, once, like a turn's new message: it is in every later turn's history.
        await admit_call(services, request, auth, texts=[body.system or ""], texts_param="system")
        return await services.conversations.create(auth.tenant_id, body.model, body.system, body.metadata)

    @router.get("/{conversation_id}")
    async def get(conversation_id: str, auth: AuthContext = Depends(call)):
        return await services.conversations.get(conversation_id, auth.tenant_id)

    @router.delete("/{conversation_id}")
    async def delete(conversation_id: str, auth: AuthContext = Depends(call)):
        await services.conversations.delete(conversation_id, auth.tenant_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @router.get("/{conversation_id}/messages")
    async def list_messages(conversation_id: str, limit: int = 20, after: str | None = None,
                            order: Literal["asc", "desc"] = "asc", auth: AuthContext = Depends(call)):
        return await services.conversations.messages(conversation_id, auth.tenant_id, limit, after, order)

    @router.post("/{conversation_id}/messages")
    async def add_turn(conversation_id: str, body: TurnRequest, request: Request,
                       auth: AuthContext = Depends(caller)):
        conversation = await services.conversations.owned(conversation_id, auth.tenant_id)
        model = body.model or conversation["model"]
        if not model:
            raise OpenAIError(400, "This conversation has no model: pass `model`.", param="model",
                              code="invalid_request")
        body = body.model_copy(update={"model": model, "n": 1})
        limits = services.config.gateway.limits
        history, left_out = await services.conversations.history(conversation, limits.max_history_messages,
                                                                  limits.max_history_chars)
        check_bounds(body, limits, num_history=len(history))
        history.append(ChatMessage(body.role, body.content, tool_call_id=body.tool_call_id))
        # What the model reads is the whole history; what is new, and judged, is the message.
        ticket = await admit(services, request, request_ticket(
            auth, body, num_chars=sum(len(m.content) for m in history), routing_text=body.content,
            texts=[body.content], texts_param="content"))

        async def store(outcome: Outcome) -> None:
            # Both turns land together, once the reply ended; a reply cut short is kept, marked incomplete.
            await services.conversations.store_turn(ConversationTurn(
                outcome.request_id, conversation_id, body.content, outcome.text,
                "completed" if outcome.completed else "incomplete",
                user_role=body.role, tool_call_id=body.tool_call_id, assistant_tool_calls=outcome.tool_calls))

        return await answered(services, ticket, services.completions.chat(
            body, ticket, messages=history, on_finish=store, extra={"conversation_id": conversation_id},
            left_out=left_out, gone=until_gone(request)))

    return router
