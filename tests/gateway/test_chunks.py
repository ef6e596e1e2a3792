"""Stream chunks as a client parses them: every chunk has the response's fields, in OpenAI's order, its one choice,
``usage: null`` when usage was asked for, and padding when obfuscation is on."""

from __future__ import annotations

import json
import time

import pytest

from switchyard.domain.api.shapes import CHAT, TEXT
from switchyard.gateway.completion_shapes import ChunkBuilder, Shape
from switchyard.shared.messages import GenerateRequest, SamplingParams, TokenDelta


def _events(data: list[bytes]) -> list[dict]:
    out = []
    for chunk in data:
        assert chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
        out.append(json.loads(chunk[6:]))
    return out


@pytest.mark.parametrize("kind", [CHAT, TEXT], ids=["chat", "text"])
@pytest.mark.parametrize("include_usage", [False, True])
@pytest.mark.parametrize("extra", [{}, {"conversation_id": "conv_1"}])
def test_every_chunk_has_the_responses_fields_and_its_choice(kind, include_usage, extra):
    request = GenerateRequest("r1", "m", "pro", SamplingParams(n=2), created_at=time.time(), deadline_at=0, prompt="x")
    chunks = ChunkBuilder(Shape(kind, stream=True, include_usage=include_usage, service_tier="default",
                                extra=extra), request)
    data = chunks.from_delta(TokenDelta("r1", text='say "hi"\n', num_tokens=2, index=1))
    data += chunks.from_delta(TokenDelta("r1", text="", index=0, finish_reason="stop"))
    first, last = _events(data)
    head = ["id", "object", "created", "model", "service_tier", *extra, "choices"] + (["usage"] if include_usage
                                                                                       else [])
    assert list(first) == head and list(last) == head
    assert first["id"] == kind.id_prefix + "r1" and first["object"] == kind.object_chunk
    assert {k: first[k] for k in extra} == extra and first.get("usage", None) is None
    (choice,) = first["choices"]
    assert choice["index"] == 1 and (choice["delta"]["content"] if kind.is_chat else choice["text"]) == 'say "hi"\n'
    assert last["choices"][0]["finish_reason"] == "stop"


def test_obfuscation_pads_each_chunk_differently():
    request = GenerateRequest("r2", "m", "pro", SamplingParams(), created_at=time.time(), deadline_at=0, prompt="x")
    chunks = ChunkBuilder(Shape(CHAT, stream=True, include_usage=True, include_obfuscation=True), request)
    events = _events([c for _ in range(20) for c in chunks.from_delta(TokenDelta("r2", text="a", num_tokens=1))])
    assert all(list(e)[-2:] == ["usage", "obfuscation"] and e["obfuscation"] for e in events)
    assert len({e["obfuscation"] for e in events}) > 1
