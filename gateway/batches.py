"""``/v1/batches``: the OpenAI Batch API, per tenant. The routes only record intent in Postgres; the leading
gateway's ``BatchRunner`` (gateway/batch_runner.py) validates, runs, cancels and finalizes.

    POST /v1/batches                {input_file_id, endpoint, completion_window: "24h", metadata?} → Batch
    GET  /v1/batches                ?after=&limit=                                                 → list
    GET  /v1/batches/{id}                                                                          → Batch
    POST /v1/batches/{id}/cancel                                                                   → Batch

    validating ──▶ in_progress ──▶ finalizing ──▶ completed
        │               │
        ▼               ├──▶ expired (past completion_window; finished lines are kept)
      failed            ▼
                    cancelling ──▶ cancelled (once nothing runs; finished lines are kept)
"""

from __future__ import annotations

import json
import secrets
import time

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict, Field

from switchyard.gateway.auth import AuthContext
from switchyard.gateway.batch_format import COMPLETION_WINDOWS, ENDPOINTS
from switchyard.gateway.errors import OpenAIError

TERMINAL = ("completed", "failed", "expired", "cancelled")
_TIMESTAMPS = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
               "expired_at", "cancelling_at", "cancelled_at")


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="ignore")  # e.g. output_expires_after: accepted, not applied

    input_file_id: str = Field(min_length=1)
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)


def _ts(value) -> int | None:
    return None if value is None else int(value.timestamp())


def batch_json(row, counts: dict | None) -> dict:
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


async def live_counts(pool, batch_ids: list[str]) -> dict[str, dict]:
    rows = await pool.fetch(
        "SELECT batch_id, count(*) AS total, count(*) FILTER (WHERE status = 'completed') AS completed, "
        "count(*) FILTER (WHERE status = 'failed') AS failed FROM batch_lines WHERE batch_id = ANY($1) "
        "GROUP BY batch_id", batch_ids)
    return {r["batch_id"]: {"total": r["total"], "completed": r["completed"], "failed": r["failed"]} for r in rows}


async def _render(pool, rows) -> list[dict]:
    running = [r["id"] for r in rows if r["status"] not in TERMINAL]
    counts = await live_counts(pool, running) if running else {}
    return [batch_json(r, counts.get(r["id"])) for r in rows]


def batch_not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No batch found with id '{batch_id}'.", code="not_found", param="batch_id")


def batches_router(caller) -> APIRouter:
    """``caller`` authenticates (the app's dependency, shared with chat)."""
    router = APIRouter(prefix="/v1/batches")

    async def owned(request: Request, batch_id: str, auth: AuthContext):
        row = await request.app.state.pool.fetchrow("SELECT * FROM batches WHERE id = $1 AND tenant_id = $2",
                                                    batch_id, auth.tenant_id)
        if row is None:
            raise batch_not_found(batch_id)
        return row

    @router.post("")
    async def create(body: BatchCreate, request: Request, auth: AuthContext = Depends(caller)):
        if body.endpoint not in ENDPOINTS:
            raise OpenAIError(400, f"Unsupported endpoint {body.endpoint!r}; supported: {', '.join(ENDPOINTS)}.",
                              code="invalid_value", param="endpoint")
        window = COMPLETION_WINDOWS.get(body.completion_window)
        if window is None:
            raise OpenAIError(400, f"Unsupported completion_window {body.completion_window!r}; supported: "
                              f"{', '.join(COMPLETION_WINDOWS)}.", code="invalid_value", param="completion_window")
        pool = request.app.state.pool
        purpose = await pool.fetchval("SELECT purpose FROM files WHERE id = $1 AND tenant_id = $2 "
                                      "AND deleted_at IS NULL", body.input_file_id, auth.tenant_id)
        if purpose is None:
            raise OpenAIError(404, f"No such File object: {body.input_file_id}", code="not_found",
                              param="input_file_id")
        if purpose != "batch":
            raise OpenAIError(400, f"The input file has purpose {purpose!r}; a batch needs purpose 'batch'.",
                              code="invalid_value", param="input_file_id")
        row = await pool.fetchrow(
            "INSERT INTO batches (id, tenant_id, api_key_id, input_file_id, endpoint, completion_window, metadata, "
            "expires_at) VALUES ($1, $2, $3, $4, $5, $6, $7, to_timestamp($8)) RETURNING *",
            f"batch_{secrets.token_hex(12)}", auth.tenant_id, auth.key_id, body.input_file_id, body.endpoint,
            body.completion_window, json.dumps(body.metadata) if body.metadata is not None else None,
            time.time() + window)
        return batch_json(row, None)

    @router.get("")
    async def list_batches(request: Request, limit: int = 20, after: str | None = None,
                           auth: AuthContext = Depends(caller)):
        if not 1 <= limit <= 100:
            raise OpenAIError(400, "limit must be between 1 and 100.", param="limit", code="invalid_value")
        args: list = [auth.tenant_id, limit + 1]
        cursor = ""
        if after is not None:
            args.append(after)
            cursor = "AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = $3 AND tenant_id = $1)"
        pool = request.app.state.pool
        rows = await pool.fetch(f"SELECT * FROM batches WHERE tenant_id = $1 {cursor} "
                                "ORDER BY created_at DESC, id DESC LIMIT $2", *args)
        data = await _render(pool, rows[:limit])
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    @router.get("/{batch_id}")
    async def retrieve(batch_id: str, request: Request, auth: AuthContext = Depends(caller)):
        return (await _render(request.app.state.pool, [await owned(request, batch_id, auth)]))[0]

    @router.post("/{batch_id}/cancel")
    async def cancel(batch_id: str, request: Request, auth: AuthContext = Depends(caller)):
        pool = request.app.state.pool
        row = await pool.fetchrow(
            "UPDATE batches SET status = 'cancelling', cancelling_at = now() WHERE id = $1 AND tenant_id = $2 "
            "AND status IN ('validating', 'in_progress') RETURNING *", batch_id, auth.tenant_id)
        if row is None:
            row = await owned(request, batch_id, auth)
            if row["status"] not in ("cancelling", "cancelled"):
                raise OpenAIError(409, f"Cannot cancel a batch with status '{row['status']}'.",
                                  code="invalid_state", param="batch_id")
        return (await _render(pool, [row]))[0]

    return router
