"""Server-side conversations: ``/v1/conversations`` and their messages, stored in Postgres per tenant.

    POST   /v1/conversations                  {model?, system?, metadata?}
    GET    /v1/conversations/{id}
    GET    /v1/conversations/{id}/messages    ?limit=&after=&order=asc|desc
    POST   /v1/conversations/{id}/messages    {content, model?, stream?, max_tokens?, ...}: the reply, like chat
    DELETE /v1/conversations/{id}

A new turn sends the whole stored history (system prompt first) to the worker, which drops the oldest turns
if it exceeds the context and says how many (``dropped_messages``). Both the user message and the reply are
stored only once the reply ends; a reply cut short (client gone) is stored with status ``incomplete``. Another
tenant's conversation answers 404, exactly like one that does not exist.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Literal

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from switchyard.gateway.auth import AuthContext
from switchyard.gateway.database import CALL_TIMEOUT_S, OUTAGE_ERRORS, bounded
from switchyard.gateway.errors import OpenAIError
from switchyard.gateway.protocol import ChatCompletionRequest, unsupported
from switchyard.gateway.responses import tool_call_from_json, tool_call_json
from switchyard.gateway.serving import Outcome
from switchyard.shared import subjects
from switchyard.shared.jetstream import publish_once
from switchyard.shared.messages import ChatMessage, ConversationTurn, encode

log = logging.getLogger("switchyard.gateway")


class ConversationCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    system: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict, max_length=16)


class TurnRequest(ChatCompletionRequest):
    """A chat completion whose history is the conversation's: ``content`` is the new message, the user's, or a
    tool's result (``role`` tool with the ``tool_call_id`` it answers)."""

    model: str | None = None  # defaults to the conversation's model
    content: str = Field(min_length=1)
    role: Literal["user", "tool"] = "user"
    tool_call_id: str | None = None
    messages: list = Field(default_factory=list, exclude=True)  # not accepted here: the server has the history

    @model_validator(mode="after")
    def _tool_result_names_its_call(self) -> "TurnRequest":
        if (self.role == "tool") != (self.tool_call_id is not None):
            raise ValueError("a tool message needs tool_call_id, and only a tool message has one")
        if self.messages:
            raise unsupported("messages", "A conversation's history is on the server: send only the new message, "
                                          "as content.")
        return self


def _conv_json(row) -> dict:
    return {"id": row["id"], "object": "conversation", "created_at": int(row["created_at"].timestamp()),
            "model": row["model"], "system": row["system_prompt"], "metadata": json.loads(row["metadata"])}


def _msg_json(row) -> dict:
    out = {"id": row["id"], "object": "conversation.message", "role": row["role"], "content": row["content"],
           "status": row["status"], "created_at": int(row["created_at"].timestamp())}
    if row["tool_calls"] is not None:
        out["tool_calls"] = json.loads(row["tool_calls"])
    if row["tool_call_id"] is not None:
        out["tool_call_id"] = row["tool_call_id"]
    return out


def _history_message(row) -> ChatMessage:
    calls = [tool_call_from_json(c) for c in json.loads(row["tool_calls"])] if row["tool_calls"] is not None else None
    return ChatMessage(row["role"], row["content"], tool_calls=calls, tool_call_id=row["tool_call_id"])


async def write_turn(pool, turn: ConversationTurn) -> None:
    """Store a turn's two messages in one transaction. Their ids come from the request id, so writing a turn
    again (a held one redelivered) stores nothing twice."""
    calls = json.dumps([tool_call_json(c) for c in turn.assistant_tool_calls]) if turn.assistant_tool_calls else None
    async with pool.acquire() as conn, conn.transaction():
        for suffix, role, content, status, tool_calls, call_id in (
                ("q", turn.user_role, turn.user_content, "completed", None, turn.tool_call_id),
                ("a", "assistant", turn.assistant_content, turn.status, calls, None)):
            await conn.execute(
                "INSERT INTO conversation_messages (id, conversation_id, role, content, status, request_id, "
                "tool_calls, tool_call_id) VALUES ($1, $2, $3, $4, $5, $6, $7::jsonb, $8) ON CONFLICT (id) DO NOTHING",
                f"msg_{turn.request_id}_{suffix}", turn.conversation_id, role, _storable(content), status,
                turn.request_id, tool_calls, call_id)


def _storable(text: str) -> str:
    # Postgres text cannot hold NUL; a model (or client) can produce one. Keep the position visible.
    return text.replace("\x00", "\ufffd")


def not_found(conversation_id: str) -> OpenAIError:
    return OpenAIError(404, f"No conversation found with id '{conversation_id}'.", code="not_found",
                       param="conversation_id")


def conversations_router(caller, admit) -> APIRouter:
    """``caller`` authenticates; ``admit`` applies rate limits (both from the app, shared with chat)."""
    router = APIRouter(prefix="/v1/conversations")

    async def owned(request: Request, conversation_id: str, auth: AuthContext):
        row = await request.app.state.pool.fetchrow(
            "SELECT * FROM conversations WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL",
            conversation_id, auth.tenant_id)
        if row is None:
            raise not_found(conversation_id)
        return row

    @router.post("")
    async def create(body: ConversationCreate, request: Request, auth: AuthContext = Depends(caller)):
        row = await request.app.state.pool.fetchrow(
            "INSERT INTO conversations (id, tenant_id, model, system_prompt, metadata) VALUES ($1, $2, $3, $4, $5) "
            "RETURNING *", f"conv_{secrets.token_hex(12)}", auth.tenant_id, body.model, body.system,
            json.dumps(body.metadata))
        return _conv_json(row)

    @router.get("/{conversation_id}")
    async def get(conversation_id: str, request: Request, auth: AuthContext = Depends(caller)):
        return _conv_json(await owned(request, conversation_id, auth))

    @router.delete("/{conversation_id}")
    async def delete(conversation_id: str, request: Request, auth: AuthContext = Depends(caller)):
        await owned(request, conversation_id, auth)
        await request.app.state.pool.execute("UPDATE conversations SET deleted_at = now() WHERE id = $1",
                                             conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @router.get("/{conversation_id}/messages")
    async def list_messages(conversation_id: str, request: Request, limit: int = 20, after: str | None = None,
                            order: Literal["asc", "desc"] = "asc", auth: AuthContext = Depends(caller)):
        await owned(request, conversation_id, auth)
        if not 1 <= limit <= 100:
            raise OpenAIError(400, "limit must be between 1 and 100.", param="limit", code="invalid_value")
        cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        cursor = "" if after is None else (
            f"AND seq {cmp} (SELECT seq FROM conversation_messages WHERE id = $3 AND conversation_id = $1)")
        args = [conversation_id, limit + 1] + ([after] if after is not None else [])
        rows = await request.app.state.pool.fetch(
            f"SELECT * FROM conversation_messages WHERE conversation_id = $1 {cursor} "
            f"ORDER BY seq {direction} LIMIT $2", *args)
        data = [_msg_json(r) for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    @router.post("/{conversation_id}/messages")
    async def add_turn(conversation_id: str, body: TurnRequest, request: Request,
                       auth: AuthContext = Depends(caller)):
        conv = await owned(request, conversation_id, auth)
        model = body.model or conv["model"]
        if not model:
            raise OpenAIError(400, "This conversation has no model: pass `model`.", param="model",
                              code="invalid_request")
        body = body.model_copy(update={"model": model, "n": 1})
        pool = request.app.state.pool
        history = [ChatMessage("system", conv["system_prompt"])] if conv["system_prompt"] else []
        history += [_history_message(r) for r in await pool.fetch(
            "SELECT role, content, tool_calls, tool_call_id FROM conversation_messages WHERE conversation_id = $1 "
            "ORDER BY seq", conversation_id)]
        history.append(ChatMessage(body.role, body.content, tool_call_id=body.tool_call_id))
        model, service, admission = await admit(request, auth, model, body.max_completion_tokens or body.max_tokens,
                                                sum(len(m.content) for m in history), 1, body.service_tier,
                                                body.content)
        body = body.model_copy(update={"model": model})

        async def store(outcome: Outcome) -> None:
            # Both turns land together, once the reply ended; a reply cut short is kept, marked incomplete.
            turn = ConversationTurn(
                outcome.request_id, conversation_id, body.content, outcome.text,
                "completed" if outcome.completed else "incomplete",
                user_role=body.role, tool_call_id=body.tool_call_id, assistant_tool_calls=outcome.tool_calls)
            try:
                await bounded(write_turn(pool, turn), CALL_TIMEOUT_S)
            except OUTAGE_ERRORS as exc:  # held in JetStream; jobs/held_writes.py writes it once Postgres is back
                log.warning("conversation %s: Postgres unavailable (%r), turn %s held", conversation_id, exc,
                            turn.request_id)
                await publish_once(request.app.state.js, subjects.HELD_TURN_SUBJECT, encode(turn), turn.request_id)

        return await request.app.state.service.chat(body, service, auth, admission, messages=history,
                                                    on_finish=store, extra={"conversation_id": conversation_id})

    return router
