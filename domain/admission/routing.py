"""Admission policy: which model serves a request, aliases and ``model: "auto"`` routed by the operator's rules.

    model in route_names ("auto")?  ──yes──▶ first rule (GatewayConfig.routes) that matches the request and whose
          │                                  model a worker serves ──▶ that model (none: 503 model_unavailable)
          no
          ▼
    an alias a worker (or the catalog) gives ──▶ its model;  anything else ──▶ the name as given

A rule matches on the tier, the prompt's estimated tokens (characters / 4, as admission reserves them), the
completion tokens asked for, and ``difficulty``: a cheap score in [0, 1] from the request's own text. The response
names the model that served, and billing prices it (its usage row has that model).
"""

from __future__ import annotations

import math
import re

from switchyard.domain.admission.pipeline import Policy
from switchyard.domain.admission.ticket import Ticket
from switchyard.domain.errors import service_unavailable
from switchyard.domain.registry import ModelRegistry
from switchyard.shared.config import GatewayConfig, RouteRule

_RETRY_AFTER_S = 5

# Difficulty features, each a share of the score. Why these: a router must decide in microseconds on the gateway
# (no model to run there), and what makes a prompt hard for a small model is visible in its text: length, code,
# mathematics, and explicit asks for reasoning or strict constraints. A score is explainable ("long + code"), so an
# operator can tune thresholds against their own traffic.
_CODE = re.compile(r"```|\bdef |\bclass |\breturn\b|[{};]\s*$|=>|\bfunction\b|#include|SELECT\s", re.M | re.I)
_MATH = re.compile(r"[=<>^√∑∫]|\d+\s*[-+*/^]\s*\d+|\b(prove|integral|derivative|equation|theorem|probability)\b",
                   re.I)
_REASONING = re.compile(r"\b(why|explain|step[- ]by[- ]step|analy[sz]e|compare|trade-?offs?|design|evaluate|derive|"
                        r"reason|justify|plan)\b", re.I)
_CONSTRAINTS = re.compile(r"\b(must|exactly|at least|at most|without|only|ensure|format|json|table)\b", re.I)


def difficulty(text: str) -> float:
    """A score in [0, 1]: 0 for a short chit-chat line, near 1 for a long technical request."""
    if not text:
        return 0.0
    length = min(1.0, math.log10(1 + len(text)) / 4)  # 10 chars ~0.26, 1000 ~0.75, 10 000 ~1
    code = min(1.0, len(_CODE.findall(text)) / 3)
    maths = min(1.0, len(_MATH.findall(text)) / 3)
    reasoning = min(1.0, len(_REASONING.findall(text)) / 2)
    constraints = min(1.0, len(_CONSTRAINTS.findall(text)) / 3)
    questions = min(1.0, text.count("?") / 3)
    score = 0.35 * length + 0.2 * code + 0.15 * maths + 0.15 * reasoning + 0.1 * constraints + 0.05 * questions
    return round(min(1.0, score), 3)


def matches(rule: RouteRule, tier: str, prompt_tokens: int, max_tokens: int | None, score: float) -> bool:
    return not (
        (rule.tiers is not None and tier not in rule.tiers)
        or (rule.min_prompt_tokens is not None and prompt_tokens < rule.min_prompt_tokens)
        or (rule.max_prompt_tokens is not None and prompt_tokens > rule.max_prompt_tokens)
        or (rule.max_completion_tokens is not None and (max_tokens or 0) > rule.max_completion_tokens)
        or (rule.min_difficulty is not None and score < rule.min_difficulty)
        or (rule.max_difficulty is not None and score > rule.max_difficulty)
    )


class Router:
    """Resolves the ``model`` a client named into the served model that runs it."""

    def __init__(self, registry: ModelRegistry, config: GatewayConfig) -> None:
        self._registry = registry
        self._routes = config.routes
        self._route_names = set(config.route_names) if config.routes else set()

    @property
    def route_names(self) -> set[str]:
        return self._route_names

    async def resolve(self, model: str, tier: str, num_chars: int, max_tokens: int | None, text: str) -> str:
        if model not in self._route_names:
            return await self._registry.resolve(model)
        prompt_tokens = math.ceil(num_chars / 4)  # as admission estimates it (limits.estimate_tokens)
        score = difficulty(text)
        served = await self._registry.models()
        for rule in self._routes:
            if matches(rule, tier, prompt_tokens, max_tokens, score):
                target = await self._registry.resolve(rule.model)
                if target in served:
                    return target
        raise service_unavailable(f"No model that `{model}` routes this request to is serving right now; please "
                                  "retry.", _RETRY_AFTER_S, code="model_unavailable")


class ModelRouting(Policy):
    """After the tier (a rule may match on it): the served model replaces the name asked for. API requests only: a
    batch line names a served model (its file is checked against the live ones before it starts)."""

    def __init__(self, router: Router) -> None:
        self._router = router

    async def check(self, ticket: Ticket) -> None:
        tier = ticket.tier
        assert tier is not None  # ServiceTierChoice, the first policy, has chosen it
        ticket.model = await self._router.resolve(ticket.model, tier, ticket.num_chars, ticket.max_tokens,
                                                  ticket.routing_text)
