"""The admission policies, in the order they run: the one list every door uses (the gateway's routes, the batch
runner's batches and lines).

    policy                 file                  judges                  decides / refuses
    1 ServiceTierChoice    service_tier.py       all                     the tier (service_tier, tier header) / 403
    2 ModelRouting         routing.py            API requests            the served model (aliases, "auto") / 503
    3 MonthlyBudget        budget.py             requests, batches, lines a token reservation / 429 insufficient_quota
    4 RateLimits           rate_limits.py        API requests and calls  a token reservation, x-ratelimit-* / 429
    5 Concurrency          concurrency.py        API requests            a seat among the tenant's open requests / 429
    6 EnqueuedBatchTokens  batch_tokens.py       batches                 429 token_limit_exceeded
    7 ModelServed          model_served.py       API requests            404 model_not_found / 503 model_unavailable
    8 InputFilter          safety.py             requests, calls, lines  the safety policy sent on / 400

API requests generate (chat, completions, a conversation turn); API calls do not (files, batches, usage, the other
conversation routes): every route counts against its key's request rate through this one list.

Why this order: the tier first (limits, routing rules and prices depend on it), then the model (a rule may match
on the tier); refusals that cost a cached read (budget) before those that write (the rate window's reservation);
the live-model check and the input filter last, so a refused request never paid for a classifier run. A new rule
is a file here (a ``Policy`` subclass) and a line in this list.
"""

from __future__ import annotations

from switchyard.domain.admission.batch_tokens import EnqueuedBatchTokens
from switchyard.domain.admission.budget import MonthlyBudget
from switchyard.domain.admission.concurrency import Concurrency
from switchyard.domain.admission.model_served import ModelServed
from switchyard.domain.admission.pipeline import Pipeline
from switchyard.domain.admission.rate_limits import RateLimits
from switchyard.domain.admission.routing import ModelRouting, Router
from switchyard.domain.admission.safety import InputFilter, InputSafety
from switchyard.domain.admission.service_tier import ServiceTierChoice
from switchyard.domain.database import Database
from switchyard.domain.limits import Limiter
from switchyard.domain.registry import ModelRegistry
from switchyard.shared.tier_store import PolicyCache


def admission_pipeline(*, db: Database, registry: ModelRegistry, router: Router, tier_policies: PolicyCache,
                       safety: InputSafety | None, local_share: float = 1.0) -> Pipeline:
    """The pipeline of one process (a gateway, or the jobs). ``local_share``: the part of each key's rate limits
    this gateway enforces alone while Postgres is away (1 / the number of gateways)."""
    return Pipeline([
        ServiceTierChoice(),
        ModelRouting(router),
        MonthlyBudget(db),
        RateLimits(Limiter(db, local_share), tier_policies),
        Concurrency(db, tier_policies, local_share),
        EnqueuedBatchTokens(db, tier_policies),
        ModelServed(registry),
        InputFilter(safety),
    ])
