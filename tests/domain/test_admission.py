"""The admission pipeline without servers: policies run in order on the tickets they judge, a refusal gives back
what the policies before it took, and a body tells admission what it asks for one way whatever door it came in by."""

from __future__ import annotations

import pytest

from switchyard.domain.admission.pipeline import ALL_ORIGINS, Pipeline, Policy
from switchyard.domain.admission.service_tier import ServiceTierChoice
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.api.chat import ChatCompletionRequest
from switchyard.domain.api.completions import CompletionRequest
from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.shared.tiers import BATCH_TIER

AUTH = AuthContext("t1", "tenant", "k1", "pro", None, None, None)


class Recording(Policy):
    def __init__(self, name: str, log: list, origins=ALL_ORIGINS, refuse: bool = False) -> None:
        self.name, self.log, self.origins, self.refuse = name, log, frozenset(origins), refuse

    async def check(self, ticket: Ticket) -> None:
        self.log.append(("check", self.name))
        if self.refuse:
            raise OpenAIError(429, "no", code="refused")

    async def settle(self, ticket: Ticket, used_tokens: int | None) -> None:
        self.log.append(("settle", self.name, used_tokens))


def ticket(origin: Origin = Origin.REQUEST) -> Ticket:
    return Ticket(origin, AUTH, "r1", "m")


async def test_policies_run_in_order_on_the_origins_they_judge_and_settle_once_in_reverse():
    log: list = []
    pipeline = Pipeline([Recording("a", log), Recording("b", log, origins={Origin.BATCH}), Recording("c", log)])
    admitted = await pipeline.check(ticket())
    await pipeline.settle(admitted, 7)
    await pipeline.settle(admitted, 9)  # a second settle (a stream's and a handler's) changes nothing
    assert log == [("check", "a"), ("check", "c"), ("settle", "c", 7), ("settle", "a", 7)]


async def test_a_refusal_gives_back_what_the_policies_before_it_took():
    log: list = []
    pipeline = Pipeline([Recording("a", log), Recording("b", log, refuse=True), Recording("c", log)])
    with pytest.raises(OpenAIError) as refused:
        await pipeline.check(ticket())
    assert refused.value.code == "refused"
    assert log == [("check", "a"), ("check", "b"), ("settle", "a", 0)]


@pytest.mark.parametrize("origin", [Origin.BATCH, Origin.BATCH_LINE])
async def test_batches_and_their_lines_run_on_the_batch_tier_whatever_they_ask(origin):
    t = Ticket(origin, AUTH, "r1", "m", service_tier="priority")
    await ServiceTierChoice().check(t)
    assert t.tier == BATCH_TIER


def test_a_body_says_what_it_asks_for_one_way():
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hello"}], max_tokens=5,
                                 max_completion_tokens=9, n=2)
    t = Ticket.for_body(Origin.REQUEST, AUTH, "r1", chat)
    assert (t.max_tokens, t.n, t.texts, t.texts_param) == (9, 2, ["hello"], "messages")
    assert t.estimated_tokens == 2 + 2 * 9  # 5 characters ~ 2 tokens, and every choice's completion
    assert chat.sampling().max_tokens == 9  # what the worker gets is what admission reserved for

    text = CompletionRequest(model="m", prompt=["one", "two"], best_of=3, n=1)
    t = Ticket.for_body(Origin.REQUEST, AUTH, "r1", text)
    assert (t.max_tokens, t.n, t.texts, t.texts_param, t.service_tier) == (16, 6, ["one", "two"], "prompt", None)
    ids = CompletionRequest(model="m", prompt=[1, 2, 3])  # token ids: nothing the gateway can read
    assert Ticket.for_body(Origin.REQUEST, AUTH, "r1", ids).texts == []
