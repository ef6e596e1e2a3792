"""Admission policy: what one tenant may hold at once, across every gateway: requests generating (streamed or not)
and their sequences, every choice of each. Beyond either cap: 429 ``concurrency_limit_exceeded`` with Retry-After.

    caps      the tenant's own (tenants.max_streams / max_sequences), else its tier's (TierPolicy); the tenant's
              tier, whatever service_tier the request asks for: flex changes the queue and the price, not the limits
    counting  one row per open request in ``open_requests``, inserted under a per-tenant advisory lock when the
              tenant's count (``open_request_counts``, kept by triggers) allows, deleted when the request ends
              (settle); a gateway renews the leases of what it still serves (``upkeep``, every
              pipeline.UPKEEP_EVERY_S), so a crashed gateway's rows expire after ``LEASE_S``
    bursts    a tenant's requests that arrive while its last admission statement runs go together in the next
              one (domain/grouped_calls.py, migration 0019), judged in arrival order: a burst of a thousand waits
              for a few statements, not a thousand round trips one after another
    outage    while Postgres is away each gateway holds its share of every tenant's caps in memory

Why not a bare counter: a counter a crashed gateway never decrements locks its tenants out for good; a lease
cannot. The count the admission reads is kept from the leases' own rows (by triggers, migration 0019), so it falls
when a lease expires as when a request ends.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import NamedTuple

import asyncpg

from switchyard.domain.admission.pipeline import Policy
from switchyard.domain.admission.ticket import Ticket
from switchyard.domain.database import Database, DatabaseUnavailable
from switchyard.domain.errors import OpenAIError
from switchyard.domain.grouped_calls import GroupedCalls
from switchyard.shared.tier_store import PolicyCache

LEASE_S = 300.0  # several upkeep rounds: a gateway that missed one keeps its requests' seats
RETRY_AFTER_S = 1  # a seat frees when one of the tenant's own requests ends: soon, but when is not known
# The advisory lock's key space: the tenant id hashed with this seed, apart from the other advisory locks.
_LOCK_SEED = 0x5359_434F_4E43
_ADMIT_SQL = ("SELECT admit_open_requests($1, $2::text[], $3::int[], $4::bigint[], $5::bigint[], $6::float8, "
              "$7::bigint)")
_CLOSE_SQL = "DELETE FROM open_requests WHERE request_id = ANY($1::text[])"


class _Asked(NamedTuple):
    """One request asking for a seat, as the admission statement takes it."""

    request_id: str
    sequences: int
    max_streams: int
    max_sequences: int


async def _admit(pool: asyncpg.Pool, tenant_id: str, asked: list[_Asked]) -> list[bool]:
    """One statement for ``asked`` (one tenant's, in arrival order): whether each got a seat."""
    rows = await pool.fetch(_ADMIT_SQL, tenant_id, [a.request_id for a in asked], [a.sequences for a in asked],
                            [a.max_streams for a in asked], [a.max_sequences for a in asked], LEASE_S, _LOCK_SEED)
    admitted = {row[0] for row in rows}
    return [a.request_id in admitted for a in asked]


async def _close(pool: asyncpg.Pool, tenant_id: str, request_ids: list[str]) -> list[None]:
    """One statement for the ended requests of one tenant (its count's row is updated once, by the trigger)."""
    await pool.execute(_CLOSE_SQL, request_ids)
    return [None] * len(request_ids)


def _refusal(what: str) -> OpenAIError:
    return OpenAIError(429, f"Too many {what} at once for your organization. Wait for one of your requests to "
                       "end, then retry.", type="rate_limit_error", code="concurrency_limit_exceeded",
                       headers={"Retry-After": str(RETRY_AFTER_S)})


class Concurrency(Policy):
    def __init__(self, db: Database, tier_policies: PolicyCache, local_share: float = 1.0) -> None:
        """``local_share``: the part of each tenant's caps this gateway holds alone while Postgres is away."""
        self._db = db
        self._admissions = GroupedCalls(db, _admit, abandoned=self._abandoned)
        self._closes = GroupedCalls(db, _close)
        self._tier_policies = tier_policies
        self._local_share = local_share
        self._held: dict[str, str] = {}  # request id -> tenant id: this gateway's open requests
        self._local: dict[str, Counter[str]] = {}  # tenant id -> streams and sequences admitted while Postgres was away
        self._local_ids: set[str] = set()

    async def check(self, ticket: Ticket) -> None:
        auth = ticket.auth
        policy = (await self._tier_policies.get())[auth.tier]
        max_streams = auth.max_streams or policy.max_streams
        max_sequences = auth.max_sequences or policy.max_sequences
        if not max_streams and not max_sequences:
            return
        max_streams, max_sequences = max_streams or 1 << 31, max_sequences or 1 << 31
        if ticket.n > max_sequences:
            raise OpenAIError(429, f"This request runs {ticket.n} sequences, over your limit of {max_sequences} "
                              "at once: lower n.", type="rate_limit_error", code="concurrency_limit_exceeded",
                              param="n")
        try:
            # One statement for every request of the tenant's that arrived meanwhile (migration 0019): the tenant's
            # advisory lock serialises its admissions (not others'), its count read under it then includes every
            # earlier one, and the lock is held for no turn of our event loop.
            admitted = await self._admissions.call(auth.tenant_id, _Asked(ticket.request_id, ticket.n, max_streams,
                                                                          max_sequences))
        except DatabaseUnavailable:
            admitted = self._admit_locally(ticket, max_streams, max_sequences)
        if not admitted:
            raise _refusal(f"requests (limit {max_streams}) or sequences (limit {max_sequences})")
        ticket.holds_seat = True
        if ticket.request_id not in self._local_ids:
            self._held[ticket.request_id] = ticket.auth.tenant_id

    def _admit_locally(self, ticket: Ticket, max_streams: int, max_sequences: int) -> bool:
        held = self._local.setdefault(ticket.auth.tenant_id, Counter())
        if (held["streams"] + 1 > max(1, math.floor(max_streams * self._local_share))
                or held["sequences"] + ticket.n > max(1, math.floor(max_sequences * self._local_share))):
            return False
        held.update(streams=1, sequences=ticket.n)
        self._local_ids.add(ticket.request_id)
        return True

    async def _abandoned(self, tenant_id: str, asked: _Asked, admitted: bool) -> None:
        """A request whose caller went away while its admission statement ran: its seat, if it got one, is freed
        (nobody would settle it)."""
        if admitted:
            await self._closes.call(tenant_id, asked.request_id)

    async def settle(self, ticket: Ticket, used_tokens: int | None) -> None:
        if not ticket.holds_seat:
            return
        ticket.holds_seat = False
        if ticket.request_id in self._local_ids:
            self._local_ids.discard(ticket.request_id)
            held = self._local[ticket.auth.tenant_id]
            held.subtract({"streams": 1, "sequences": ticket.n})
            if held["streams"] <= 0:  # nothing of the tenant's held here: forgotten (tenants come and go)
                del self._local[ticket.auth.tenant_id]
            return
        self._held.pop(ticket.request_id, None)
        try:
            await self._closes.call(ticket.auth.tenant_id, ticket.request_id)
        except DatabaseUnavailable:
            pass  # its lease expires

    def tenant_state(self) -> dict[str, int]:
        return {"concurrency_requests": len(self._held) + len(self._local_ids),
                "concurrency_local_tenants": len(self._local)}

    async def upkeep(self) -> None:
        """Extend the leases of every request this gateway still serves (and drop expired rows of any)."""
        held = list(self._held)
        try:
            await self._db.run(lambda pool: pool.execute(
                "UPDATE open_requests SET expires_at = now() + make_interval(secs => $2) "
                "WHERE request_id = ANY($1)", held, LEASE_S))
            await self._db.run(lambda pool: pool.execute("DELETE FROM open_requests WHERE expires_at < now()"))
        except DatabaseUnavailable:
            pass
