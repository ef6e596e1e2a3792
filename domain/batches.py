"""Batches as the Batch API sees them, per tenant: created, listed, read and cancelled here (the routes:
gateway/routes/batches.py), which only record intent in Postgres; the jobs' ``BatchRunner`` (jobs/batch_runner.py)
validates, runs, cancels and finalizes.

    validating ──▶ in_progress ──▶ finalizing ──▶ completed
        │               │
        ▼               ├──▶ expired (past completion_window; finished lines are kept)
      failed            ▼
                    cancelling ──▶ cancelled (once nothing runs; finished lines are kept)
"""

from __future__ import annotations

import builtins
import json
import secrets
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import asyncpg

from switchyard.domain.auth import AuthContext
from switchyard.domain.batch_format import COMPLETION_WINDOWS, ENDPOINTS
from switchyard.domain.database import inserted_row
from switchyard.domain.errors import OpenAIError
from switchyard.domain.files import Files

TERMINAL = ("completed", "failed", "expired", "cancelled")
LINE_STATES = ("pending", "queued", "completed", "failed", "cancelled")
_ACTIVE_LINES_SQL = """
SELECT l.status, count(*) AS n FROM batch_lines l JOIN batches b ON b.id = l.batch_id
WHERE b.status IN ('validating', 'in_progress', 'finalizing', 'cancelling') GROUP BY l.status
"""
_TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
               "expired_at", "cancelling_at", "cancelled_at")


def _ts(value: datetime | None) -> int | None:
    return None if value is None else int(value.timestamp())


def batch_json(row: asyncpg.Record, counts: dict[str, int] | None) -> dict[str, Any]:
    """The OpenAI Batch object. ``counts``: live counts for a running batch (None: the row's frozen ones)."""
    stored = json.loads(row["request_counts"]) if row["request_counts"] else None
    return {
        "id": row["id"], "object": "batch", "endpoint": row["endpoint"], "model": row["model"],
        "errors": json.loads(row["errors"]) if row["errors"] else None,
        "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
        "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
        **{name: _ts(row[name]) for name in _TIMESTAMPS},
        "request_counts": counts or stored or {"total": 0, "completed": 0, "failed": 0},
        "metadata": json.loads(row["metadata"]) if row["metadata"] else None,
        "usage": json.loads(row["usage"]) if row["usage"] else None,
    }


async def live_counts(pool: asyncpg.Pool, batch_ids: list[str]) -> dict[str, dict[str, int]]:
    rows = await pool.fetch(
        "SELECT batch_id, count(*) AS total, count(*) FILTER (WHERE status = 'completed') AS completed, "
        "count(*) FILTER (WHERE status = 'failed') AS failed FROM batch_lines WHERE batch_id = ANY($1) "
        "GROUP BY batch_id", batch_ids)
    return {r["batch_id"]: {"total": r["total"], "completed": r["completed"], "failed": r["failed"]} for r in rows}


def batch_not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No batch found with id '{batch_id}'.", code="not_found", param="batch_id")


class Batches:
    """A tenant's batches, through one pool."""

    def __init__(self, pool: asyncpg.Pool, files: Files) -> None:
        self._pool = pool
        self._files = files

    async def create(self, auth: AuthContext, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, Any] | None) -> dict[str, Any]:
        """A batch in ``validating``, for the runner to take up; refused at once for what needs no file read."""
        if endpoint not in ENDPOINTS:
            raise OpenAIError(400, f"Unsupported endpoint {endpoint!r}; supported: {', '.join(ENDPOINTS)}.",
                              code="invalid_value", param="endpoint")
        window = COMPLETION_WINDOWS.get(completion_window)
        if window is None:
            raise OpenAIError(400, f"Unsupported completion_window {completion_window!r}; supported: "
                              f"{', '.join(COMPLETION_WINDOWS)}.", code="invalid_value", param="completion_window")
        purpose = await self._files.purpose(input_file_id, auth.tenant_id)
        if purpose is None:
            raise OpenAIError(404, f"No such File object: {input_file_id}", code="not_found", param="input_file_id")
        if purpose != "batch":
            raise OpenAIError(400, f"The input file has purpose {purpose!r}; a batch needs purpose 'batch'.",
                              code="invalid_value", param="input_file_id")
        row = await self._pool.fetchrow(
            "INSERT INTO batches (id, tenant_id, api_key_id, input_file_id, endpoint, completion_window, metadata, "
            "expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, to_timestamp($8)) RETURNING *",
            f"batch_{secrets.token_hex(12)}", auth.tenant_id, auth.key_id, input_file_id, endpoint,
            completion_window, json.dumps(metadata) if metadata is not None else None, time.time() + window)
        return batch_json(inserted_row(row), None)

    async def list(self, tenant_id: str, limit: int, after: str | None) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise OpenAIError(400, "limit must be between 1 and 100.", param="limit", code="invalid_value")
        args: list[object] = [tenant_id, limit + 1]
        cursor = ""
        if after is not None:
            args.append(after)
            cursor = "AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = $3 AND tenant_id = $1)"
        rows = await self._pool.fetch(f"SELECT * FROM batches WHERE tenant_id = $1 {cursor} "
                                      "ORDER BY created_at DESC, id DESC LIMIT $2", *args)
        data = await self._render(rows[:limit])
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    async def get(self, batch_id: str, tenant_id: str) -> dict[str, Any]:
        return (await self._render([await self._owned(batch_id, tenant_id)]))[0]

    async def cancel(self, batch_id: str, tenant_id: str) -> dict[str, Any]:
        """Ask the runner to cancel: ``cancelling`` (once nothing runs, it is ``cancelled``)."""
        row = await self._pool.fetchrow(
            "UPDATE batches SET status = 'cancelling', cancelling_at = now() WHERE id = $1 AND tenant_id = $2 "
            "AND status IN ('validating', 'in_progress') RETURNING *", batch_id, tenant_id)
        if row is None:
            row = await self._owned(batch_id, tenant_id)
            if row["status"] not in ("cancelling", "cancelled"):
                raise OpenAIError(409, f"Cannot cancel a batch with status '{row['status']}'.",
                                  code="invalid_state", param="batch_id")
        return (await self._render([row]))[0]

    async def active_line_counts(self) -> dict[str, int]:
        """Lines of every unfinished batch, by state (the gateway's batch_lines gauge)."""
        rows = await self._pool.fetch(_ACTIVE_LINES_SQL)
        return {r["status"]: r["n"] for r in rows}

    async def _owned(self, batch_id: str, tenant_id: str) -> asyncpg.Record:
        row = await self._pool.fetchrow("SELECT * FROM batches WHERE id = $1 AND tenant_id = $2", batch_id,
                                        tenant_id)
        if row is None:
            raise batch_not_found(batch_id)
        return row

    async def _render(self, rows: Sequence[asyncpg.Record]) -> builtins.list[dict[str, Any]]:
        running = [r["id"] for r in rows if r["status"] not in TERMINAL]
        counts = await live_counts(self._pool, running) if running else {}
        return [batch_json(r, counts.get(r["id"])) for r in rows]
