"""Files: uploads for the Batch API and the batch results, per tenant, in Postgres (the routes: gateway/routes/
files.py; batch results are written by jobs/batch_store.py).

Contents live in a bytea column next to their metadata: one durable store, written in the same transaction as
the batch that produces a result file, and nothing else to back up or share between gateway replicas. Uploads
are capped (``MAX_FILE_BYTES``), which keeps a file well inside what a bytea value and one memory read handle.
Another tenant's file answers 404, exactly like one that does not exist.
"""

from __future__ import annotations

import secrets
from typing import Literal

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from switchyard.domain.errors import OpenAIError

MAX_FILE_BYTES = 50 * 1024 * 1024
UPLOAD_PURPOSES = ("batch",)
MULTIPART_SLACK = 64 * 1024  # boundaries and the other form fields around the file


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def file_json(row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": int(row["created_at"].timestamp()),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


async def insert_file(conn: asyncpg.Connection | PoolConnectionProxy, tenant_id: str, purpose: str, filename: str,
                      content: bytes):
    """Store a file; returns its row (without the content)."""
    return await conn.fetchrow(
        "INSERT INTO files (id, tenant_id, purpose, filename, bytes, content) VALUES ($1, $2, $3, $4, $5, $6) "
        "RETURNING id, purpose, filename, bytes, created_at", new_file_id(), tenant_id, purpose, filename,
        len(content), content)


def file_not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", code="not_found", param="id")


def too_large() -> OpenAIError:
    return OpenAIError(400, f"The file is larger than the {MAX_FILE_BYTES // (1024 * 1024)} MB limit; split it "
                       "into several batches.", code="file_too_large", param="file")


_COLUMNS = "id, purpose, filename, bytes, created_at"


class Files:
    """A tenant's files, through one pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    async def create(self, tenant_id: str, purpose: str, filename: str, content: bytes) -> dict:
        async with self._pool.acquire() as conn:
            return file_json(await insert_file(conn, tenant_id, purpose, filename, content))

    async def get(self, file_id: str, tenant_id: str) -> dict:
        row = await self._pool.fetchrow(
            f"SELECT {_COLUMNS} FROM files WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL",
            file_id, tenant_id)
        if row is None:
            raise file_not_found(file_id)
        return file_json(row)

    async def list(self, tenant_id: str, purpose: str | None, limit: int, after: str | None,
                   order: Literal["asc", "desc"]) -> dict:
        if not 1 <= limit <= 10_000:
            raise OpenAIError(400, "limit must be between 1 and 10000.", param="limit", code="invalid_value")
        cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        args: list = [tenant_id, purpose, limit + 1]
        cursor = ""
        if after is not None:
            args.append(after)
            cursor = (f"AND (created_at, id) {cmp} (SELECT created_at, id FROM files WHERE id = $4 "
                      "AND tenant_id = $1)")
        rows = await self._pool.fetch(
            f"SELECT {_COLUMNS} FROM files WHERE tenant_id = $1 AND deleted_at IS NULL "
            f"AND ($2::text IS NULL OR purpose = $2) {cursor} ORDER BY created_at {direction}, id {direction} "
            "LIMIT $3", *args)
        data = [file_json(r) for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    async def content(self, file_id: str, tenant_id: str) -> bytes:
        data = await self._pool.fetchval(
            "SELECT content FROM files WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL", file_id, tenant_id)
        if data is None:
            raise file_not_found(file_id)
        return bytes(data)

    async def delete(self, file_id: str, tenant_id: str) -> None:
        # The row stays (batches refer to it by id); the content goes, so a delete really frees the space.
        status = await self._pool.execute(
            "UPDATE files SET deleted_at = now(), content = ''::bytea WHERE id = $1 AND tenant_id = $2 "
            "AND deleted_at IS NULL", file_id, tenant_id)
        if status.endswith(" 0"):
            raise file_not_found(file_id)

    async def purpose(self, file_id: str, tenant_id: str) -> str | None:
        """A live file's purpose (None: no such file of the tenant's)."""
        return await self._pool.fetchval("SELECT purpose FROM files WHERE id = $1 AND tenant_id = $2 "
                                         "AND deleted_at IS NULL", file_id, tenant_id)
