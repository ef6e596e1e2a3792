"""The admission pipeline: policies run in order on a ticket before it is queued, and settle after it ends.

    check:  policy 1 ─▶ policy 2 ─▶ ... ─▶ queued        a refusal (OpenAIError) stops it there, and the policies
                                                          already passed settle at once with nothing used
    settle: ... ─▶ policy 2 ─▶ policy 1                   once, with the tokens the request used

A policy is one rule in one file (``domain/admission/*.py``), in the manner of LiteLLM's proxy hooks: ``check``
refuses (raises ``OpenAIError``) or fills in what it decides on the ticket; ``settle`` gives back or charges what
it took. ``origins`` says which tickets it judges (an API request, a batch, a batch line), so every door runs the
same list (``policies.py``) and a rule never has a second copy for batches.
"""

from __future__ import annotations

from collections.abc import Sequence

from switchyard.domain.admission.ticket import Origin, Ticket

ALL_ORIGINS = frozenset(Origin)
UPKEEP_EVERY_S = 60.0


class Policy:
    """One admission rule. Subclasses override ``check`` and, when they hold something for a request (a
    reservation, a seat), ``settle``."""

    origins: frozenset[Origin] = frozenset({Origin.REQUEST})

    async def check(self, ticket: Ticket) -> None:
        """Refuse ``ticket`` by raising ``OpenAIError``, or let it through (filling in what this policy decides)."""

    async def settle(self, ticket: Ticket, used_tokens: int | None) -> None:
        """The request ended having used ``used_tokens`` (0: it never ran; None: unknown here, e.g. a stream the
        client left, which the worker bills)."""

    def tenant_state(self) -> dict[str, int]:
        """What the policy holds in memory per tenant or key: structure -> entries (shared/tenant_state.py)."""
        return {}

    async def upkeep(self) -> None:
        """Periodic work of a policy that holds something for requests still running (renewing leases); the
        process that admits requests calls it every ``UPKEEP_EVERY_S``."""


class Pipeline:
    """The policies, in the order they run."""

    def __init__(self, policies: Sequence[Policy]) -> None:
        self.policies = list(policies)

    def _for(self, ticket: Ticket) -> list[Policy]:
        return [p for p in self.policies if ticket.origin in p.origins]

    async def check(self, ticket: Ticket) -> Ticket:
        """Run every policy that judges ``ticket``'s origin; raises the first refusal, after the policies already
        passed have settled with nothing used."""
        passed: list[Policy] = []
        try:
            for policy in self._for(ticket):
                await policy.check(ticket)
                passed.append(policy)
        except BaseException:
            for policy in reversed(passed):
                await policy.settle(ticket, 0)
            raise
        return ticket

    def tenant_state(self) -> dict[str, int]:
        """Every policy's (see ``Policy.tenant_state``)."""
        return {structure: entries for policy in self.policies for structure, entries in policy.tenant_state().items()}

    async def upkeep(self) -> None:
        """Every policy's periodic work (see ``Policy.upkeep``)."""
        for policy in self.policies:
            await policy.upkeep()

    async def settle(self, ticket: Ticket, used_tokens: int | None) -> None:
        """Settle a ticket that passed ``check``, last policy first; only the first call counts."""
        if ticket.settled:
            return
        ticket.settled = True
        for policy in reversed(self._for(ticket)):
            await policy.settle(ticket, used_tokens)
