"""Tenants and API keys in Postgres: the operations behind ``switchyard tenants|keys`` and the first start.

A key is ``sk-sy-`` + 32 url-safe random characters (190 bits); only its sha256 is stored, with a short prefix
for listings. The secret is shown once, at creation.
"""

from __future__ import annotations

import hashlib
import secrets
from dataclasses import dataclass
from typing import Any

import asyncpg

from switchyard.shared.tiers import FIRST_TENANT_TIER, NEW_TENANT_TIER, TIER_NAMES

KEY_PREFIX = "sk-sy-"


def hash_key(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


def new_id(kind: str) -> str:
    return f"{kind}_{secrets.token_hex(8)}"


@dataclass(frozen=True, slots=True)
class NewKey:
    id: str
    tenant_id: str
    secret: str  # shown once; never stored
    prefix: str


class TenancyError(ValueError):
    """A tenant or key operation that cannot be done; the message says why."""


def _check_tier(tier: str) -> None:
    if tier not in TIER_NAMES:
        raise TenancyError(f"unknown tier {tier!r}; known: {', '.join(TIER_NAMES)}")


async def create_tenant(conn: asyncpg.Connection, name: str, tier: str = NEW_TENANT_TIER, *,
                        rpm_limit: int | None = None, tpm_limit: int | None = None,
                        monthly_token_budget: int | None = None, max_streams: int | None = None,
                        max_sequences: int | None = None) -> str:
    _check_tier(tier)
    tenant_id = new_id("ten")
    try:
        await conn.execute(
            "INSERT INTO tenants (id, name, tier, rpm_limit, tpm_limit, monthly_token_budget, max_streams, "
            "max_sequences) VALUES ($1, $2, $3, $4, $5, $6, $7, $8)", tenant_id, name, tier, rpm_limit, tpm_limit,
            monthly_token_budget, max_streams, max_sequences)
    except asyncpg.UniqueViolationError:
        raise TenancyError(f"a tenant named {name!r} already exists") from None
    return tenant_id


_UPDATABLE = ("tier", "rpm_limit", "tpm_limit", "monthly_token_budget", "priority_allowed", "safety_policy",
              "max_streams", "max_sequences")
SAFETY_POLICIES = ("off", "log", "block")  # domain/admission/safety.py; None: the deployment's default


async def update_tenant(conn: asyncpg.Connection, name: str, **changes: Any) -> None:
    """Set the given fields (a value of None clears a limit back to the tier default / unlimited)."""
    if "tier" in changes:
        _check_tier(changes["tier"])
    if changes.get("safety_policy") not in (None, *SAFETY_POLICIES):
        raise TenancyError(f"unknown safety policy {changes['safety_policy']!r}; known: {', '.join(SAFETY_POLICIES)}")
    fields = [f for f in _UPDATABLE if f in changes]
    if not fields:
        return
    sets = ", ".join(f"{f} = ${i + 2}" for i, f in enumerate(fields))
    status = await conn.execute(f"UPDATE tenants SET {sets} WHERE name = $1", name, *(changes[f] for f in fields))
    if status.endswith(" 0"):
        raise TenancyError(f"no tenant named {name!r}")


async def list_tenants(conn: asyncpg.Connection) -> list[asyncpg.Record]:
    return await conn.fetch("SELECT * FROM tenants ORDER BY created_at")


async def tenant_id_by_name(conn: asyncpg.Connection, name: str) -> str:
    tenant_id: str | None = await conn.fetchval("SELECT id FROM tenants WHERE name = $1", name)
    if tenant_id is None:
        raise TenancyError(f"no tenant named {name!r}")
    return tenant_id


async def create_key(conn: asyncpg.Connection, tenant_name: str, name: str | None = None) -> NewKey:
    tenant_id = await tenant_id_by_name(conn, tenant_name)
    secret = KEY_PREFIX + secrets.token_urlsafe(24)
    key = NewKey(new_id("key"), tenant_id, secret, secret[: len(KEY_PREFIX) + 4])
    await conn.execute("INSERT INTO api_keys (id, tenant_id, key_hash, prefix, name) VALUES ($1, $2, $3, $4, $5)",
                       key.id, tenant_id, hash_key(secret), key.prefix, name)
    return key


async def list_keys(conn: asyncpg.Connection, tenant_name: str | None = None) -> list[asyncpg.Record]:
    return await conn.fetch(
        "SELECT k.id, t.name AS tenant, k.prefix, k.name, k.created_at, k.last_used_at, k.revoked_at "
        "FROM api_keys k JOIN tenants t ON t.id = k.tenant_id WHERE $1::text IS NULL OR t.name = $1 "
        "ORDER BY k.created_at", tenant_name)


async def revoke_key(conn: asyncpg.Connection, key_id: str) -> None:
    status = await conn.execute("UPDATE api_keys SET revoked_at = now() WHERE id = $1 AND revoked_at IS NULL", key_id)
    if status.endswith(" 0"):
        raise TenancyError(f"no active key {key_id!r}")


async def ensure_default_tenant(conn: asyncpg.Connection) -> NewKey | None:
    """On a first start (no tenants at all): a `default` tenant (on ``FIRST_TENANT_TIER``) and one key for it."""
    if await conn.fetchval("SELECT count(*) FROM tenants"):
        return None
    await create_tenant(conn, "default", FIRST_TENANT_TIER)
    return await create_key(conn, "default", "created by switchyard up")
