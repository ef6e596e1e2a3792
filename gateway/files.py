"""``/v1/files``: uploads for the Batch API and the batch results, per tenant, in Postgres.

    POST   /v1/files                multipart: file, purpose=batch        → File object
    GET    /v1/files                ?purpose=&limit=&after=&order=        → list
    GET    /v1/files/{id}                                                 → File object
    GET    /v1/files/{id}/content                                         → the bytes
    DELETE /v1/files/{id}                                                 → {"id", "object": "file", "deleted"}

Contents live in a bytea column next to their metadata: one durable store, written in the same transaction as
the batch that produces a result file, and nothing else to back up or share between gateway replicas. Uploads
are capped (``MAX_FILE_BYTES``), which keeps a file well inside what a bytea value and one memory read handle.
Another tenant's file answers 404, exactly like one that does not exist.
"""

from __future__ import annotations

import secrets
from typing import Literal

import asyncpg
from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from switchyard.gateway.auth import AuthContext
from switchyard.gateway.errors import OpenAIError

MAX_FILE_BYTES = 50 * 1024 * 1024
UPLOAD_PURPOSES = ("batch",)
MULTIPART_SLACK = 64 * 1024  # boundaries and the other form fields around the file


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


def file_json(row) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": int(row["created_at"].timestamp()),
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "expires_at": None,
            "status_details": None}


async def insert_file(conn: asyncpg.Connection, tenant_id: str, purpose: str, filename: str, content: bytes):
    """Store a file; returns its row (without the content)."""
    return await conn.fetchrow(
        "INSERT INTO files (id, tenant_id, purpose, filename, bytes, content) VALUES ($1, $2, $3, $4, $5, $6) "
        "RETURNING id, purpose, filename, bytes, created_at", new_file_id(), tenant_id, purpose, filename,
        len(content), content)


def file_not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", code="not_found", param="id")


def _too_large() -> OpenAIError:
    return OpenAIError(400, f"The file is larger than the {MAX_FILE_BYTES // (1024 * 1024)} MB limit; split it "
                       "into several batches.", code="file_too_large", param="file")


def files_router(caller) -> APIRouter:
    """``caller`` authenticates (the app's dependency, shared with chat)."""
    router = APIRouter(prefix="/v1/files")
    columns = "id, purpose, filename, bytes, created_at"

    async def owned(request: Request, file_id: str, auth: AuthContext):
        row = await request.app.state.pool.fetchrow(
            f"SELECT {columns} FROM files WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL",
            file_id, auth.tenant_id)
        if row is None:
            raise file_not_found(file_id)
        return row

    # The form is read by hand (after authentication, bounded by its declared size); the schema still describes it,
    # so clients and fuzzers (tests/e2e/test_openapi_fuzz.py) see the real request body.
    @router.post("", openapi_extra={"requestBody": {"required": True, "content": {"multipart/form-data": {"schema": {
        "type": "object", "required": ["file", "purpose"],
        "properties": {"file": {"type": "string", "format": "binary"},
                       "purpose": {"type": "string", "enum": list(UPLOAD_PURPOSES)}}}}}}})
    async def upload(request: Request, auth: AuthContext = Depends(caller)):
        # The form is parsed here, after authentication, and refused by its declared size before it is read.
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > MAX_FILE_BYTES + MULTIPART_SLACK:
            raise _too_large()
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose not in UPLOAD_PURPOSES:
                raise OpenAIError(400, f"Invalid purpose {purpose!r}: supported purposes are "
                                  f"{', '.join(UPLOAD_PURPOSES)}.", code="invalid_value", param="purpose")
            if upload is None or isinstance(upload, str):
                raise OpenAIError(400, "Missing required parameter: 'file'.", code="invalid_request", param="file")
            content = await upload.read(MAX_FILE_BYTES + 1)
            if len(content) > MAX_FILE_BYTES:
                raise _too_large()
            filename = upload.filename or "upload.jsonl"
        async with request.app.state.pool.acquire() as conn:
            row = await insert_file(conn, auth.tenant_id, purpose, filename, content)
        return file_json(row)

    @router.get("")
    async def list_files(request: Request, purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                         order: Literal["asc", "desc"] = "desc", auth: AuthContext = Depends(caller)):
        if not 1 <= limit <= 10_000:
            raise OpenAIError(400, "limit must be between 1 and 10000.", param="limit", code="invalid_value")
        cmp, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        args: list = [auth.tenant_id, purpose, limit + 1]
        cursor = ""
        if after is not None:
            args.append(after)
            cursor = (f"AND (created_at, id) {cmp} (SELECT created_at, id FROM files WHERE id = $4 "
                      "AND tenant_id = $1)")
        rows = await request.app.state.pool.fetch(
            f"SELECT {columns} FROM files WHERE tenant_id = $1 AND deleted_at IS NULL "
            f"AND ($2::text IS NULL OR purpose = $2) {cursor} ORDER BY created_at {direction}, id {direction} "
            "LIMIT $3", *args)
        data = [file_json(r) for r in rows[:limit]]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": len(rows) > limit}

    @router.get("/{file_id}")
    async def retrieve(file_id: str, request: Request, auth: AuthContext = Depends(caller)):
        return file_json(await owned(request, file_id, auth))

    @router.get("/{file_id}/content")
    async def content(file_id: str, request: Request, auth: AuthContext = Depends(caller)):
        data = await request.app.state.pool.fetchval(
            "SELECT content FROM files WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL",
            file_id, auth.tenant_id)
        if data is None:
            raise file_not_found(file_id)
        return Response(content=bytes(data), media_type="application/octet-stream")

    @router.delete("/{file_id}")
    async def delete(file_id: str, request: Request, auth: AuthContext = Depends(caller)):
        # The row stays (batches refer to it by id); the content goes, so a delete really frees the space.
        status = await request.app.state.pool.execute(
            "UPDATE files SET deleted_at = now(), content = ''::bytea WHERE id = $1 AND tenant_id = $2 "
            "AND deleted_at IS NULL", file_id, auth.tenant_id)
        if status.endswith(" 0"):
            raise file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return router
