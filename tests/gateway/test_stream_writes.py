"""How a streamed chat completion reaches the socket, without servers: each item ``CompletionService._stream``
yields is one send, so one write to the client's socket. Chunks already at hand go out together: the last delta's
with the usage chunk and ``[DONE]``, deltas that arrived together in one; a delta that arrives alone is sent at
once, never held for the next. ``RelayedDouble`` is a named
test double of the relayed request (the real relay is tested end to end in tests/e2e/test_openai_api.py)."""

from __future__ import annotations

import json

from switchyard.domain.api.shapes import CHAT
from switchyard.gateway.completion_shapes import Shape
from switchyard.gateway.serving import CompletionService
from switchyard.shared.messages import GenerateRequest, SamplingParams, TokenDelta, Usage

USAGE = Usage(prompt_tokens=3, completion_tokens=3)


class RelayedDouble:
    """Test double: the deltas after the first, in ``arrivals`` (each a list of deltas that arrived together: all
    but the last of a list are pending while the stream handles one); finished once the ``is_last`` one is out."""

    def __init__(self, arrivals: list[list[TokenDelta]]) -> None:
        self.request = GenerateRequest("r1", "tiny", "pro", SamplingParams(max_tokens=8), 0.0, 0.0)
        self.arrivals = arrivals
        self.next_delta_waits = True

    async def deltas(self):
        for together in self.arrivals:
            for i, delta in enumerate(together):
                self.next_delta_waits = i == len(together) - 1 and not delta.is_last
                yield delta


class Service(CompletionService):
    """CompletionService without a relay or admission behind it: ``end`` only records that it ran."""

    def __init__(self) -> None:
        super().__init__(relay=None, registry=None, tier_policies=None, admission=None, config=None)
        self.ended = False

    async def end(self, relayed, ticket, outcome, used_tokens, on_finish=None) -> None:
        self.ended = True


def token(text: str, **fields) -> TokenDelta:
    return TokenDelta("r1", text=text, num_tokens=1, **fields)


async def sends(arrivals: list[list[TokenDelta]], include_usage: bool = True) -> list[list[dict | str]]:
    service = Service()
    shape = Shape(CHAT, stream=True, include_usage=include_usage)
    first = TokenDelta("r1")  # the worker took the request
    written = [chunk async for chunk in service._stream(RelayedDouble(arrivals), first, shape, None, _Outcome(),
                                                        None)]
    assert service.ended
    return [[line[6:] if line == "data: [DONE]" else json.loads(line[6:]) for line in chunk.decode().splitlines()
             if line.startswith("data: ")] for chunk in written]


class _Outcome:
    usage = None

    def take(self, reply) -> None:
        pass


def kinds(send: list[dict | str]) -> list[str]:
    def kind(event):
        if event == "[DONE]":
            return "done"
        if not event["choices"]:
            return "usage"
        delta = event["choices"][0]["delta"]
        return "role" if "role" in delta else ("finish" if event["choices"][0]["finish_reason"] else delta["content"])
    return [kind(e) for e in send]


async def test_a_one_token_stream_ends_in_one_write():
    written = await sends([[token("Hi", finish_reason="stop", usage=USAGE, is_last=True)]])
    # the opening when the worker took the request (its first delta has no text); then everything else at once
    assert [kinds(s) for s in written] == [["role"], ["Hi", "finish", "usage", "done"]]


async def test_each_lone_delta_is_sent_at_once_and_the_last_with_the_end():
    written = await sends([[token("a")], [token("b")], [token("c", finish_reason="stop", usage=USAGE,
                                                                is_last=True)]])
    assert [kinds(s) for s in written] == [["role"], ["a"], ["b"], ["c", "finish", "usage", "done"]]


async def test_deltas_that_arrived_together_are_one_write():
    written = await sends([[token("a"), token("b"), token("c")],
                           [token("d", finish_reason="length", usage=USAGE, is_last=True)]], include_usage=False)
    assert [kinds(s) for s in written] == [["role"], ["a", "b", "c"], ["d", "finish", "done"]]  # usage: not asked
