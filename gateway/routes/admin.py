"""The admin HTTP API (ops): tier queues and live tier policies, behind ``Authorization: Bearer <admin_key>``.

Disabled (every route answers 404) unless the gateway is configured with an admin key.
"""

from __future__ import annotations

import hmac
from typing import Literal

import msgspec
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from switchyard.domain.errors import OpenAIError
from switchyard.domain.tier_admin import TierChangeError, change_tier, tier_status
from switchyard.gateway.services import GatewayServices


class TierUpdate(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_queued: int | None = Field(None, ge=1)
    max_queued_per_tenant: int | None = Field(None, ge=0)  # 0: a quarter of max_queued
    max_wait_s: float | None = Field(None, gt=0)
    weight: float | None = Field(None, gt=0)
    max_streams: int | None = Field(None, ge=0)  # 0: no cap
    max_sequences: int | None = Field(None, ge=0)
    hedge_after_ms: int | Literal["auto", "off"] | None = None  # 0 or "off": no hedging
    hedge_budget: float | None = Field(None, gt=0, le=1)
    pause_after_tokens: int | None = Field(None, ge=0)  # 0: no pausing (scheduler/pausing.py)


def router(services: GatewayServices) -> APIRouter:
    router = APIRouter(prefix="/admin")
    admin_key = services.config.gateway.admin_key

    def authorize(request: Request) -> None:
        if not admin_key:
            raise OpenAIError(404, "The admin API is disabled: set SWITCHYARD_GATEWAY__ADMIN_KEY.", code="not_found")
        given = request.headers.get("authorization", "").removeprefix("Bearer ").strip()
        # Constant-time comparison: response timing must not reveal how much of a guessed key was right.
        if not hmac.compare_digest(given.encode(), admin_key.encode()):
            raise OpenAIError(401, "Invalid admin key.", type="invalid_request_error", code="invalid_api_key")

    @router.get("/tiers")
    async def get_tiers(request: Request):
        authorize(request)
        served = await services.registry.models(fresh=True)
        return {"object": "list", "data": await tier_status(services.js, served)}

    @router.put("/tiers/{tier}")
    async def put_tier(tier: str, body: TierUpdate, request: Request):
        authorize(request)
        try:
            old, new = await change_tier(services.js, services.db.pool, tier, "admin-api", **body.model_dump())
        except TierChangeError as exc:
            raise OpenAIError(400, str(exc), code="invalid_value", param="tier") from None
        services.tier_policies.invalidate()  # other gateways follow within a second
        return {"tier": tier, "old": _plain(old), "new": _plain(new)}

    return router


def _plain(policy) -> dict:
    return msgspec.to_builtins(policy)
