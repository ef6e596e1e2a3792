"""Server-side conversations and their messages, stored in Postgres per tenant (the routes: gateway/routes/
conversations.py).

A new turn sends the whole stored history (system prompt first) to the worker, which drops the oldest turns if it
exceeds the context. Both the user message and the reply are stored only once the reply ends (``store_turn``); a
reply cut short is stored with status ``incomplete``. While Postgres is away a turn is held in JetStream
(``HELD_WRITES``) and written by the jobs once it is back (jobs/held_writes.py, ``write_turn``). Another tenant's
conversation is "not found", exactly like one that does not exist.
"""

from __future__ import annotations

import json
import logging
import secrets
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from switchyard.domain.api.shapes import tool_call_from_json, tool_call_json
from switchyard.domain.database import CALL_TIMEOUT_S, OUTAGE_ERRORS, Connection, bounded, inserted_row
from switchyard.domain.errors import OpenAIError
from switchyard.shared import subjects
from switchyard.shared.jetstream import publish_once
from switchyard.shared.messages import ChatMessage, ConversationTurn, encode

log = logging.getLogger("switchyard.conversations")


def conversation_json(row: asyncpg.Record) -> dict[str, Any]:
    return {"id": row["id"], "object": "conversation", "created_at": int(row["created_at"].timestamp()),
            "model": row["model"], "system": row["system_prompt"], "metadata": json.loads(row["metadata"])}


def message_json(row: asyncpg.Record) -> dict[str, Any]:
    out: dict[str, Any] = {"id": row["id"], "object": "conversation.message", "role": row["role"],
           "content": json.loads(row["content"]), "status": row["status"],
           "created_at": int(row["created_at"].timestamp())}
    if row["tool_calls"] is not None:
        out["tool_calls"] = json.loads(row["tool_calls"])
    if row["tool_call_id"] is not None:
        out["tool_call_id"] = row["tool_call_id"]
    return out


def _history_message(row: asyncpg.Record) -> ChatMessage:
    calls = [tool_call_from_json(c) for c in json.loads(row["tool_calls"])] if row["tool_calls"] is not None else None
    return ChatMessage(row["role"], json.loads(row["content"]), tool_calls=calls, tool_call_id=row["tool_call_id"])


async def write_turn(pool: asyncpg.Pool, turn: ConversationTurn) -> None:
    """Store a turn's two messages in one transaction. Their ids come from the request id, so writing a turn
    again (a held one redelivered) stores nothing twice."""
    async with pool.acquire() as conn, conn.transaction():
        await insert_messages(conn, turn.conversation_id, turn.request_id, [
            ("q", ChatMessage(turn.user_role, turn.user_content, tool_call_id=turn.tool_call_id), "completed"),
            ("a", ChatMessage("assistant", turn.assistant_content, tool_calls=turn.assistant_tool_calls or None),
             turn.status)])


async def insert_messages(conn: Connection, conversation_id: str, request_id: str,
                          messages: list[tuple[str, ChatMessage, str]]) -> None:
    """Append ``(id suffix, message, status)`` rows to a conversation, in order. Each id is the request id and its
    suffix: written again, nothing is stored twice."""
    # The text goes in as a JSON string (migration 0016: a model may write U+0000), escaped only where JSON must,
    # so the history's length bound still counts about one character per character.
    for suffix, m, status in messages:
        calls = json.dumps([tool_call_json(c) for c in m.tool_calls]) if m.tool_calls else None
        await conn.execute(
            "INSERT INTO conversation_messages (id, conversation_id, role, content, status, request_id, "
            "tool_calls, tool_call_id) VALUES ($1, $2, $3, $4::json, $5, $6, $7::jsonb, $8) "
            "ON CONFLICT (id) DO NOTHING",
            f"msg_{request_id}_{suffix}", conversation_id, m.role, json.dumps(m.content, ensure_ascii=False), status,
            request_id, calls, m.tool_call_id)


# The newest messages first, with the running length of their text; the outer query keeps those within the bound
# (the index on (conversation_id, seq) lets the scan stop after ``$2`` rows).
_HISTORY_SQL = """
SELECT role, content, tool_calls, tool_call_id, total FROM (
    SELECT role, content, tool_calls, tool_call_id, seq,
           sum(length(content::text)) OVER (ORDER BY seq DESC) AS chars,
           (SELECT count(*) FROM conversation_messages WHERE conversation_id = $1) AS total
    FROM conversation_messages WHERE conversation_id = $1 ORDER BY seq DESC LIMIT $2
) newest WHERE chars <= $3 ORDER BY seq DESC
"""


def not_found(conversation_id: str) -> OpenAIError:
    return OpenAIError(404, f"No conversation found with id '{conversation_id}'.", code="not_found",
                       param="conversation_id")


class Conversations:
    """A tenant's conversations, through one pool; turns held in JetStream while Postgres is away."""

    def __init__(self, pool: asyncpg.Pool, js: JetStreamContext) -> None:
        self._pool = pool
        self._js = js

    async def create(self, tenant_id: str, model: str | None, system: str | None,
                     metadata: dict[str, Any]) -> dict[str, Any]:
        row = await self._pool.fetchrow(
            "INSERT INTO conversations (id, tenant_id, model, system_prompt, metadata) VALUES ($1, $2, $3, $4, $5) "
            "RETURNING *", f"conv_{secrets.token_hex(12)}", tenant_id, model, system, json.dumps(metadata))
        return conversation_json(inserted_row(row))

    async def owned(self, conversation_id: str, tenant_id: str) -> asyncpg.Record:
        """The conversation's row; raises 404 for one that does not exist or is another tenant's."""
        row = await self._pool.fetchrow(
            "SELECT * FROM conversations WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL",
            conversation_id, tenant_id)
        if row is None:
            raise not_found(conversation_id)
        return row

    async def get(self, conversation_id: str, tenant_id: str) -> dict[str, Any]:
        return conversation_json(await self.owned(conversation_id, tenant_id))

    async def delete(self, conversation_id: str, tenant_id: str) -> None:
        await self.owned(conversation_id, tenant_id)
        await self._pool.execute("UPDATE conversations SET deleted_at = now() WHERE id = $1", conversation_id)

    async def messages(self, conversation_id: str, tenant_id: str, limit: int, after: str | None,
                       order: str) -> dict[str, Any]:
        """A page of the conversation's messages, as OpenAI lists things (``first_id``, ``last_id``, ``has_more``)."""
        await self.owned(conversation_id, tenant_id)
        if not 1 <= limit <= 100:
            raise OpenAIError(400, "limit must be between 1 and 100.", param="limit", code="invalid_value")
        cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        cursor = "" if after is None else (
            f"AND seq {cmp} (SELECT seq FROM conversation_messages WHERE id = $3 AND conversation_id = $1)")
        args = [conversation_id, limit + 1] + ([after] if after is not None else [])
        rows = await self._pool.fetch(
            f"SELECT * FROM conversation_messages WHERE conversation_id = $1 {cursor} "
            f"ORDER BY seq {direction} LIMIT $2", *args)
        data = [message_json(r) for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    async def history(self, conversation: asyncpg.Record, max_messages: int,
                      max_chars: int) -> tuple[list[ChatMessage], int]:
        """What the model reads before a new message: the system prompt, then the newest stored messages in order,
        at most ``max_messages`` of them and ``max_chars`` of their text; and how many older ones were left out.
        The newest are read first, so a long conversation costs what the bounds allow, not its whole length."""
        history = [ChatMessage("system", conversation["system_prompt"])] if conversation["system_prompt"] else []
        rows = await self._pool.fetch(_HISTORY_SQL, conversation["id"], max_messages, max_chars)
        total = rows[0]["total"] if rows else await self._pool.fetchval(
            "SELECT count(*) FROM conversation_messages WHERE conversation_id = $1", conversation["id"])
        history += [_history_message(r) for r in reversed(rows)]
        return history, total - len(rows)

    async def store_turn(self, turn: ConversationTurn) -> None:
        """Both messages of a turn whose reply ended; held in JetStream if Postgres cannot take them now."""
        try:
            await bounded(write_turn(self._pool, turn), CALL_TIMEOUT_S)
        except OUTAGE_ERRORS as exc:  # held in JetStream; jobs/held_writes.py writes it once Postgres is back
            log.warning("conversation %s: Postgres unavailable (%r), turn %s held", turn.conversation_id, exc,
                        turn.request_id)
            await publish_once(self._js, subjects.HELD_TURN_SUBJECT, encode(turn), turn.request_id)
