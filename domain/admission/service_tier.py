"""Admission policy: OpenAI's ``service_tier`` on this platform's tiers, which tier runs a request and what the
response says.

| asked                 | runs on                   | response says | limits                                       |
|-----------------------|---------------------------|---------------|----------------------------------------------|
| (none), auto, default | the key's tenant's tier   | default       | the tier's queue and wait                    |
| flex                  | the low (batch) tier      | flex          | up to ``flex_wait_s``; can't run soon: 429   |
| priority              | the top (enterprise) tier | priority      | only where the tenant's plan allows it (403) |

Flex is billed at the batch tier's price (jobs/usage_writer.py discounts the ``batch`` tier), shares the batch
tier's seats (it yields to interactive work, as batch lines do), and answers 429 ``resource_unavailable`` when it
could not be run soon (its queue full, or not started within its wait), as OpenAI's flex processing does.
"""

from __future__ import annotations

from switchyard.domain.admission.pipeline import ALL_ORIGINS, Policy
from switchyard.domain.admission.ticket import Origin, ServiceTier, Ticket
from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.shared.tiers import BATCH_TIER, TIER_NAMES

PRIORITY_TIER = TIER_NAMES[0]
# Errors that mean "could not be run soon": for a flex request they are its 429.
_CANNOT_RUN_SOON = ("queue_full", "queue_timeout")


def choose(asked: str | None, auth: AuthContext, tier_override: str | None = None) -> ServiceTier:
    """The tier a request runs on. ``tier_override``: a trusted deployment's tier header, used when the body
    does not ask for a service tier of its own."""
    if asked == "flex":
        return ServiceTier(BATCH_TIER, "flex")
    if asked == "priority":
        if not (auth.tier == PRIORITY_TIER or auth.priority_allowed):
            raise OpenAIError(403, "Your plan does not include priority processing (service_tier 'priority').",
                              type="permission_error", code="service_tier_not_allowed", param="service_tier")
        return ServiceTier(PRIORITY_TIER, "priority")
    return ServiceTier(tier_override or auth.tier, "default")


def flex_refusal(error: OpenAIError, retry_after_s: int) -> OpenAIError:
    """A flex request's "could not run soon" (queue full or wait over) as OpenAI answers it; other errors as
    they are."""
    if error.code not in _CANNOT_RUN_SOON:
        return error
    return OpenAIError(429, "Resource unavailable: flex capacity could not run this request soon enough; retry "
                            "later or use the default tier.", type="rate_limit_error", code="resource_unavailable",
                       headers={"Retry-After": str(retry_after_s)})


class ServiceTierChoice(Policy):
    """First: which tier runs the request decides its queue, its limits and its price. A batch and its lines run
    on the batch tier whatever their bodies say (a line may only ask for auto or default)."""

    origins = ALL_ORIGINS

    async def check(self, ticket: Ticket) -> None:
        if ticket.origin is Origin.REQUEST:
            ticket.service = choose(ticket.service_tier, ticket.auth, ticket.tier_override)
        elif ticket.origin is Origin.CALL:
            ticket.service = ServiceTier(ticket.auth.tier)
        else:
            ticket.service = ServiceTier(BATCH_TIER)
