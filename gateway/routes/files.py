"""``/v1/files``: uploads for the Batch API and batch results (domain/files.py).

    POST   /v1/files                multipart: file, purpose=batch        → File object
    GET    /v1/files                ?purpose=&limit=&after=&order=        → list
    GET    /v1/files/{id}                                                 → File object
    GET    /v1/files/{id}/content                                         → the bytes
    DELETE /v1/files/{id}                                                 → {"id", "object": "file", "deleted"}
"""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from switchyard.domain.api.text import UNSTORABLE, describe
from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.domain.files import MAX_FILE_BYTES, MULTIPART_SLACK, UPLOAD_PURPOSES, too_large
from switchyard.gateway.admission import counted
from switchyard.gateway.services import GatewayServices


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/v1/files")
    caller = counted(services)  # every call counts against its key's request rate

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
            raise too_large()
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose not in UPLOAD_PURPOSES:
                raise OpenAIError(400, f"Invalid purpose {purpose!r}: supported purposes are "
                                  f"{', '.join(UPLOAD_PURPOSES)}.", code="invalid_value", param="purpose")
            if upload is None or isinstance(upload, str):
                raise OpenAIError(400, "Missing required parameter: 'file'.", code="invalid_request", param="file")
            content = await upload.read(MAX_FILE_BYTES + 1)
            if len(content) > MAX_FILE_BYTES:
                raise too_large()
            filename = upload.filename or "upload.jsonl"
            if UNSTORABLE.search(filename):
                raise OpenAIError(400, f"Invalid value for 'file': its file name {describe(filename)}.",
                                  code="invalid_value", param="file")
        return await services.files.create(auth.tenant_id, purpose, filename, content)

    @router.get("")
    async def list_files(purpose: str | None = None, limit: int = 10_000, after: str | None = None,
                         order: Literal["asc", "desc"] = "desc", auth: AuthContext = Depends(caller)):
        return await services.files.list(auth.tenant_id, purpose, limit, after, order)

    @router.get("/{file_id}")
    async def retrieve(file_id: str, auth: AuthContext = Depends(caller)):
        return await services.files.get(file_id, auth.tenant_id)

    @router.get("/{file_id}/content")
    async def content(file_id: str, auth: AuthContext = Depends(caller)):
        return Response(content=await services.files.content(file_id, auth.tenant_id),
                        media_type="application/octet-stream")

    @router.delete("/{file_id}")
    async def delete(file_id: str, auth: AuthContext = Depends(caller)):
        await services.files.delete(file_id, auth.tenant_id)
        return {"id": file_id, "object": "file", "deleted": True}

    return router
