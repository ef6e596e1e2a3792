"""Stored Responses API responses, per tenant in Postgres (the routes: gateway/routes/responses.py).

    POST (store)        ─▶ save(StoredResponse) when it ends; a streamed one is saved ``in_progress`` as it starts
                           (another gateway can resume its stream from the row), a background one ``queued``
                           first, and both as they go (``in_progress``, then their end)
    previous_response_id ─▶ history(): every earlier response of the chain, oldest first: its input items, then
                           its output (instructions are not carried over, as OpenAI's are not)
    conversation        ─▶ the conversation's messages come first; the input and the reply are appended to it
                           in the same transaction that stores the response

A response Postgres cannot take when it ends is held in JetStream (``llm.held.response``) and written by the jobs
once it is back (jobs/held_writes.py), like a conversation turn. A write never moves a response out of a final
state (a cancelled background response stays cancelled, whatever its run wrote after). Another tenant's response is
"not found", exactly like one that does not exist.
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

import asyncpg
from nats.js import JetStreamContext

from switchyard.domain.api.response_items import to_messages
from switchyard.domain.api.response_object import TERMINAL
from switchyard.domain.conversations import insert_messages
from switchyard.domain.database import CALL_TIMEOUT_S, OUTAGE_ERRORS, bounded
from switchyard.domain.errors import OpenAIError
from switchyard.shared import subjects
from switchyard.shared.jetstream import publish_once
from switchyard.shared.messages import ChatMessage, StoredResponse, encode

log = logging.getLogger("switchyard.responses")

MAX_CHAIN = 1000  # responses followed back from a previous_response_id; beyond any context anyway
_OPEN = ("queued", "in_progress")


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"No response found with id '{response_id}'.", code="not_found", param="response_id")


_ESCAPED_NUL = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def _nul_free(text: str) -> str:
    """JSON text without U+0000 (an escape an odd number of backslashes starts): json holds it, but the ``->>``
    and jsonb a query applies cannot. The position stays visible as U+FFFD."""
    return _ESCAPED_NUL.sub(r"\1\\ufffd", text)


async def write_response(pool: asyncpg.Pool, record: StoredResponse) -> None:
    """Store ``record`` (a new response, or a later state of one) and, once it has ended, append what it adds to
    its conversation, in one transaction. Written again (a held one redelivered), nothing changes twice."""
    async with pool.acquire() as conn, conn.transaction():
        written = await conn.fetchval(
            "INSERT INTO responses (id, tenant_id, request_id, status, background, previous_response_id, "
            "conversation_id, input_items, body) VALUES ($1, $2, $3, $4, $5, $6, $7, $8::json, $9::json) "
            "ON CONFLICT (id) DO UPDATE SET status = EXCLUDED.status, body = EXCLUDED.body, updated_at = now() "
            "WHERE responses.status IN ('queued', 'in_progress') RETURNING status",
            record.response_id, record.tenant_id, record.request_id, record.status, record.background,
            record.previous_response_id, record.conversation_id, _nul_free(record.input_items),
            _nul_free(record.body))
        if written in TERMINAL and record.conversation_id and record.status in ("completed", "incomplete"):
            last = len(record.conversation_messages) - 1
            await insert_messages(conn, record.conversation_id, record.request_id, [
                (f"r{i}", m, record.status if i == last else "completed")
                for i, m in enumerate(record.conversation_messages)])


class Responses:
    """A tenant's stored responses, through one pool; held in JetStream while Postgres is away."""

    def __init__(self, pool: asyncpg.Pool, js: JetStreamContext) -> None:
        self._pool = pool
        self._js = js

    async def save(self, record: StoredResponse, hold: bool = True) -> None:
        """Store ``record``; if Postgres cannot take it now, hold it in JetStream (``hold``) or raise."""
        try:
            await bounded(write_response(self._pool, record), CALL_TIMEOUT_S)
        except OUTAGE_ERRORS as exc:
            if not hold:
                raise
            log.warning("response %s: Postgres unavailable (%r), held", record.response_id, exc)
            await publish_once(self._js, subjects.HELD_RESPONSE_SUBJECT, encode(record),
                               f"{record.response_id}.{record.status}")

    async def _row(self, response_id: str, tenant_id: str, columns: str = "*") -> asyncpg.Record:
        row = await self._pool.fetchrow(
            f"SELECT {columns} FROM responses WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL",
            response_id, tenant_id)
        if row is None:
            raise not_found(response_id)
        return row

    async def stored(self, response_id: str, tenant_id: str) -> StoredResponse:
        """The row of ``response_id`` as it stands (its body the object's latest state); 404 for another
        tenant's."""
        row = await self._row(response_id, tenant_id, "request_id, status, body, input_items, background, "
                                                      "previous_response_id, conversation_id")
        return StoredResponse(response_id, tenant_id, row["request_id"], row["status"], row["body"],
                              row["input_items"], row["background"], row["previous_response_id"],
                              row["conversation_id"])

    async def get(self, response_id: str, tenant_id: str) -> dict[str, Any]:
        body: dict[str, Any] = json.loads((await self._row(response_id, tenant_id, "body"))["body"])
        return body

    async def delete(self, response_id: str, tenant_id: str) -> None:
        row = await self._pool.fetchrow(
            "UPDATE responses SET deleted_at = now() WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL "
            "RETURNING id", response_id, tenant_id)
        if row is None:
            raise not_found(response_id)

    async def input_items(self, response_id: str, tenant_id: str, limit: int, after: str | None,
                          order: str) -> dict[str, Any]:
        """A page of the response's input items, as OpenAI lists them (``desc`` by default: newest first)."""
        if not 1 <= limit <= 100:
            raise OpenAIError(400, "limit must be between 1 and 100.", param="limit", code="invalid_value")
        items = json.loads((await self._row(response_id, tenant_id, "input_items"))["input_items"])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [i["id"] for i in items]
            items = items[ids.index(after) + 1:] if after in ids else []
        page = items[:limit]
        return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit}

    async def history(self, response_id: str, tenant_id: str) -> tuple[list[ChatMessage], str]:
        """The messages of ``response_id``'s chain, oldest first, and the model that answered it last; 400 while
        it has not ended, 404 when it is not the tenant's."""
        rows = await self._pool.fetch(
            "WITH RECURSIVE chain AS ("
            " SELECT id, previous_response_id, status, input_items, body, 0 AS depth FROM responses"
            " WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL"
            " UNION ALL"
            " SELECT r.id, r.previous_response_id, r.status, r.input_items, r.body, c.depth + 1 FROM responses r"
            " JOIN chain c ON r.id = c.previous_response_id"
            " WHERE r.tenant_id = $2 AND r.deleted_at IS NULL AND c.depth < $3"
            ") SELECT status, input_items, body->'output' AS output, body->>'model' AS model FROM chain "
            "ORDER BY depth DESC", response_id, tenant_id, MAX_CHAIN)
        if not rows:
            raise OpenAIError(404, f"Previous response with id '{response_id}' not found.", code="not_found",
                              param="previous_response_id")
        if rows[-1]["status"] in _OPEN:
            raise OpenAIError(400, f"Previous response with id '{response_id}' has not finished yet.",
                              code="invalid_request", param="previous_response_id")
        items: list[dict[str, Any]] = []
        for row in rows:
            items += json.loads(row["input_items"]) + json.loads(row["output"] or "[]")
        return to_messages(items), rows[-1]["model"]

    async def cancel(self, response_id: str, tenant_id: str) -> tuple[dict[str, Any], str | None]:
        """Mark a background response cancelled; returns its body and, if its run may still be going, its request id
        (for ``llm.cancel.<request_id>``). Cancelling a finished one changes nothing; a foreground one is a 400.

        A response housekeeping failed (``fail_abandoned``) keeps that status, but its run may be alive, on a
        gateway that was only stalled: its request id comes back too, so the worker stops spending on it."""
        row = await self._row(response_id, tenant_id, "background, status, request_id, body")
        if not row["background"]:
            raise OpenAIError(400, "Only background responses can be cancelled.", code="invalid_request",
                              param="response_id")
        body = json.loads(row["body"])
        if row["status"] not in _OPEN:
            return body, row["request_id"] if row["status"] == "failed" else None
        body.update(status="cancelled")
        updated = await self._pool.fetchval(
            "UPDATE responses SET status = 'cancelled', body = jsonb_set(body::jsonb, '{status}', '\"cancelled\"')"
            "::json, updated_at = now() WHERE id = $1 AND status IN ('queued', 'in_progress') RETURNING request_id",
            response_id)
        if updated is None:  # it ended meanwhile
            return await self.get(response_id, tenant_id), None
        return body, updated

    async def touch(self, response_id: str) -> bool:
        """A background or streamed response's run is alive (see ``fail_abandoned``); False when the response is no
        longer open (cancelled, or failed by housekeeping): its run is then wasted work."""
        touched = await self._pool.fetchval("UPDATE responses SET updated_at = now() WHERE id = $1 AND status IN "
                                            "('queued', 'in_progress') RETURNING id", response_id)
        return touched is not None


ALIVE_EVERY_S = 30.0  # the gateway running a stored response (background, or streamed) touches its row this often
ABANDONED_AFTER_S = 4 * ALIVE_EVERY_S


async def fail_abandoned(pool: asyncpg.Pool, older_than_s: float = ABANDONED_AFTER_S) -> int:
    """Open responses (background, or streamed) whose gateway stopped running them (it crashed: a draining one
    finishes them) and that no gateway resumed are failed, so a client polling one is told instead of waiting
    forever; returns how many (housekeeping)."""
    error = json.dumps({"code": "server_error", "message": "The gateway running this response stopped; please "
                                                           "create it again."})
    rows = await pool.fetch(
        "UPDATE responses SET status = 'failed', updated_at = now(), body = jsonb_set(jsonb_set(body::jsonb, "
        "'{status}', '\"failed\"'), '{error}', $2::jsonb)::json WHERE status IN ('queued', 'in_progress') "
        "AND updated_at < now() - make_interval(secs => $1) RETURNING id", older_than_s, error)
    for row in rows:
        log.warning("response %s abandoned by its gateway: failed", row["id"])
    return len(rows)
