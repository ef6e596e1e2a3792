"""The gateway's routes, one module per resource. Each module has ``router(services) -> APIRouter`` and is found
here by itself: a new endpoint is one new file in this folder.

    completions.py    POST /v1/chat/completions, POST /v1/completions
    conversations.py  /v1/conversations and their messages
    responses.py      /v1/responses (the Responses API) and their input items
    embeddings.py     POST /v1/embeddings
    files.py          /v1/files
    batches.py        /v1/batches
    models.py         GET /v1/models, GET /v1/models/{id}
    usage.py          GET /v1/usage
    health.py         GET /healthz, /readyz, /metrics
    admin.py          /admin (ops: tiers)

A route reads the body (pydantic, domain/api), authenticates (``admission.authenticated``), admits a ticket when it
queues work (``admission.admit``) and calls a named service (gateway/services.py); it holds no SQL.
"""

from __future__ import annotations

import importlib
import pkgutil

from fastapi import APIRouter

from switchyard.gateway.services import GatewayServices


def all_routers(services: GatewayServices) -> list[APIRouter]:
    """Every route module's router, in the modules' name order."""
    names = sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))
    return [importlib.import_module(f"{__name__}.{name}").router(services) for name in names]
