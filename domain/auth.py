"""API-key authentication: ``Authorization: Bearer <key>`` → the caller's tenant, key and tier (``AuthContext``),
which every admission policy reads; a batch's lines are admitted under the context of the key that created it.

Lookups go by the key's sha256 (an index probe, so timing says nothing about how close a guess was) and are
cached for ``CACHE_S`` seconds: a revoked key stops working on every gateway within that time. While Postgres is
away, a key looked up in the last ``STALE_OK_S`` keeps its last answer (its tenant is served on), and a key never
seen gets 503 with Retry-After: neither a 500 nor a hang, nor a 401 for a key that may be valid. What no request
can use any more is forgotten (``forget_idle``, the gateway's upkeep): keys come and go with their tenants.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import asyncpg

from switchyard.domain.database import Database, DatabaseUnavailable, database_unavailable
from switchyard.domain.errors import OpenAIError
from switchyard.domain.tenancy import hash_key
from switchyard.shared.single_flight import SingleFlight

CACHE_S = 5.0
STALE_OK_S = 3600.0
_LAST_USED_EVERY_S = 60.0


@dataclass(frozen=True, slots=True)
class AuthContext:
    """Who is calling: set on ``request.state.auth`` for every authenticated /v1 request."""

    tenant_id: str
    tenant_name: str
    key_id: str
    tier: str
    rpm_limit: int | None  # None: the tier's default
    tpm_limit: int | None
    monthly_token_budget: int | None  # None: unlimited
    priority_allowed: bool = False  # may ask for service_tier "priority" (domain/admission/service_tier.py)
    safety_policy: str | None = None  # off | log | block; None: the deployment's default (domain/admission/safety.py)
    max_streams: int | None = None  # requests generating at once; None: the tier's (domain/admission/concurrency.py)
    max_sequences: int | None = None  # their sequences (every choice) at once; None: the tier's


def invalid_key() -> OpenAIError:
    return OpenAIError(401, "Incorrect API key provided. You can find your API key in `switchyard keys`.",
                       code="invalid_api_key")


class Authenticator:
    def __init__(self, db: Database) -> None:
        self._db = db
        self._cache: dict[bytes, tuple[AuthContext | None, float]] = {}
        self._last_used: dict[str, float] = {}
        self._lookups: SingleFlight[AuthContext | None] = SingleFlight()

    async def authenticate(self, header: str) -> AuthContext:
        """The caller of a request whose ``Authorization`` header is ``header``; raises 401 or 503."""
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret.strip():
            raise OpenAIError(401, "You didn't provide an API key. Send it as `Authorization: Bearer <key>`.",
                              code="invalid_api_key")
        digest = hash_key(secret.strip())
        cached = self._cache.get(digest)
        now = time.monotonic()
        if cached is None or now - cached[1] > CACHE_S:
            try:
                # One lookup per key at a time: a burst on a key whose entry just expired waits for one query.
                cached = (await self._lookups.run(digest, lambda: self._read(digest)), now)
            except DatabaseUnavailable:
                if cached is None or now - cached[1] > STALE_OK_S:
                    raise database_unavailable() from None
            else:
                if len(self._cache) > 10_000:  # unbounded guessing must not grow memory without bound
                    self._cache.clear()
                self._cache[digest] = cached
        auth = cached[0]
        if auth is None:
            raise invalid_key()
        if now - self._last_used.get(auth.key_id, float("-inf")) > _LAST_USED_EVERY_S:
            self._last_used[auth.key_id] = now
            try:  # bookkeeping: never worth failing a request for
                await self._db.run(lambda pool: pool.execute("UPDATE api_keys SET last_used_at = now() WHERE id = $1",
                                                             auth.key_id))
            except DatabaseUnavailable:
                pass
        return auth

    def tenant_state(self) -> dict[str, int]:
        """Entries per API key (shared/tenant_state.py): answers cached (wrong keys' too), last uses written."""
        return {"auth_keys": len(self._cache), "auth_last_used": len(self._last_used)}

    def forget_idle(self, now: float | None = None) -> None:
        """Drop what no request can use any more, so a key that stopped calling is not held for good: an answer
        older than ``STALE_OK_S`` (a lookup replaces it, and an outage would not serve it), and a last use older
        than ``_LAST_USED_EVERY_S`` (the key's next use writes it again either way). The gateway calls it every
        minute (its upkeep)."""
        now = time.monotonic() if now is None else now
        self._cache = {digest: cached for digest, cached in self._cache.items() if now - cached[1] <= STALE_OK_S}
        self._last_used = {key_id: at for key_id, at in self._last_used.items() if now - at <= _LAST_USED_EVERY_S}

    async def _read(self, digest: bytes) -> AuthContext | None:
        return await self._db.run(lambda pool: self._lookup(pool, digest))

    @staticmethod
    async def _lookup(pool: asyncpg.Pool, digest: bytes) -> AuthContext | None:
        row = await pool.fetchrow(
            f"SELECT k.id AS key_id, {_TENANT_COLUMNS} FROM api_keys k JOIN tenants t ON t.id = k.tenant_id "
            "WHERE k.key_hash = $1 AND k.revoked_at IS NULL", digest)
        return None if row is None else _context(row)


_TENANT_COLUMNS = ("t.id AS tenant_id, t.name, t.tier, t.rpm_limit, t.tpm_limit, t.monthly_token_budget, "
                   "t.priority_allowed, t.safety_policy, t.max_streams, t.max_sequences")


def _context(row: asyncpg.Record) -> AuthContext:
    return AuthContext(row["tenant_id"], row["name"], row["key_id"], row["tier"], row["rpm_limit"], row["tpm_limit"],
                       row["monthly_token_budget"], row["priority_allowed"], row["safety_policy"], row["max_streams"],
                       row["max_sequences"])


async def tenant_context(pool: asyncpg.Pool, tenant_id: str, key_id: str | None) -> AuthContext | None:
    """The context of a tenant's own work that no request carries (its batch lines), read now: its tier, limits
    and policies as they are, under ``key_id`` (the key that created the batch). None: no such tenant."""
    row = await pool.fetchrow(f"SELECT $2::text AS key_id, {_TENANT_COLUMNS} FROM tenants t WHERE t.id = $1",
                              tenant_id, key_id)
    return None if row is None else _context(row)
