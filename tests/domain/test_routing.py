"""``model: "auto"`` routing and aliases, on a registry of fabricated workers."""

from __future__ import annotations

import pytest

from switchyard.domain.admission.routing import Router, difficulty
from switchyard.domain.errors import OpenAIError
from switchyard.shared.config import GatewayConfig, RouteRule

EASY = ["hi there", "thanks!", "What's your name?", "tell me a joke"]
HARD = [
    "Explain step by step why this function is O(n log n) and prove it:\n```python\ndef f(xs):\n    return "
    "sorted(xs)\n```",
    "Compare the trade-offs of two designs for a distributed queue; the answer must be a table with exactly "
    "three rows. Why would you choose one?",
    "Derive the integral of x^2 * e^x and justify each step; then evaluate it from 0 to 1.",
]


def test_difficulty_puts_every_technical_ask_above_every_chit_chat():
    assert max(difficulty(t) for t in EASY) < min(difficulty(t) for t in HARD)
    assert difficulty("") == 0.0 and all(0 <= difficulty(t) <= 1 for t in EASY + HARD)


class FakeRegistry:
    def __init__(self, served: dict[str, list[str]]) -> None:
        self.served = served  # model -> aliases

    async def models(self, fresh: bool = False):
        return dict.fromkeys(self.served, [])

    async def resolve(self, name: str) -> str:
        return next((m for m, aliases in self.served.items() if name == m or name in aliases), name)


RULES = [RouteRule(model="fast", max_difficulty=0.4, max_prompt_tokens=500),
         RouteRule(model="large", tiers=["enterprise", "pro"]),
         RouteRule(model="small")]


@pytest.mark.parametrize("text, tier, expected", [
    (EASY[0], "free", "small"),  # easy: the first rule, by the small model's alias
    (HARD[0], "pro", "large"),  # hard, on a tier that may use the large model
    (HARD[0], "free", "small"),  # hard, but free: the large model is not for its tier
])
async def test_auto_takes_the_first_rule_that_matches(text, tier, expected):
    router = Router(FakeRegistry({"small": ["fast"], "large": []}), GatewayConfig(routes=RULES))
    assert await router.resolve("auto", tier, len(text), 100, text) == expected


async def test_a_rule_whose_model_is_not_served_is_passed_over_and_none_left_is_a_503():
    router = Router(FakeRegistry({"large": []}), GatewayConfig(routes=RULES))
    assert await router.resolve("auto", "pro", 8, 10, EASY[0]) == "large"  # small is down: the next rule that fits
    router = Router(FakeRegistry({}), GatewayConfig(routes=RULES))
    with pytest.raises(OpenAIError) as caught:
        await router.resolve("auto", "pro", 8, 10, EASY[0])
    assert (caught.value.status, caught.value.code) == (503, "model_unavailable")


async def test_names_not_routed_resolve_as_aliases_or_stay_themselves():
    router = Router(FakeRegistry({"small": ["fast"]}), GatewayConfig(routes=RULES))
    assert await router.resolve("fast", "pro", 1, 1, "") == "small"
    assert await router.resolve("other", "pro", 1, 1, "") == "other"
    no_routes = Router(FakeRegistry({"small": []}), GatewayConfig())
    assert await no_routes.resolve("auto", "pro", 1, 1, "") == "auto"  # no routes: "auto" is just a name
