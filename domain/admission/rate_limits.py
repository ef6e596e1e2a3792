"""Admission policy: the key's requests and tokens per minute (domain/limits.py keeps the windows).

A request reserves its estimated tokens (prompt estimate + n x max_tokens) when it is admitted; when it ends the
unused part goes back and use beyond it is charged (all of it back for one that never ran; a stream the client
left keeps its reservation, since only the worker knows what it used). Every response carries the key's
``x-ratelimit-*`` headers. The limits are the key's tenant's (its own, else its tier's), whatever tier runs the
request: ``service_tier`` flex changes the queue and the price, never the limits. Every route counts against the
request rate (files, batches, usage, conversations: ``Origin.CALL``, no tokens). Batches are paced by the batch
tier, not by a key's rate.
"""

from __future__ import annotations

from switchyard.domain.admission.pipeline import Policy
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.limits import Limiter
from switchyard.shared.tier_store import PolicyCache
from switchyard.shared.tracing import tracer


class RateLimits(Policy):
    origins = frozenset({Origin.REQUEST, Origin.CALL})

    def __init__(self, limiter: Limiter, tier_policies: PolicyCache) -> None:
        self._limiter = limiter
        self._tier_policies = tier_policies

    async def check(self, ticket: Ticket) -> None:
        policy = (await self._tier_policies.get())[ticket.auth.tier]  # the tenant's, not the tier that runs it
        with tracer.start_as_current_span("rate_limits", attributes={"tier": ticket.tier}):
            ticket.reservation = await self._limiter.admit(ticket.auth, policy, ticket.estimated_tokens)
        ticket.headers.update(ticket.reservation.headers)

    async def settle(self, ticket: Ticket, used_tokens: int | None) -> None:
        reservation = ticket.reservation
        if reservation is not None:
            await self._limiter.settle(reservation, reservation.reserved_tokens if used_tokens is None else used_tokens)

    async def upkeep(self) -> None:
        """The windows this gateway kept while Postgres was away, of keys that have not called since, go (nothing
        else forgets them: the jobs' housekeeping prunes a limiter of its own)."""
        self._limiter.forget_idle()

    def tenant_state(self) -> dict[str, int]:
        return self._limiter.tenant_state()
