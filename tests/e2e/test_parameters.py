"""Every parameter of OpenAI's chat and legacy completions requests is honoured or refused with a 400 naming it
(README, "Parameters"): nothing a client sends is silently dropped. Sent through the official ``openai`` client;
what its signature lacks (vLLM's extensions, parameters this platform refuses, one OpenAI has not) goes in
``extra_body``, as a client would send it.
"""

from __future__ import annotations

import inspect
import json

import asyncpg
import openai
import pytest
from openai import AsyncOpenAI

from tests.e2e.conftest import TINY
from tests.support.system import poll
from tests.support.tiny_model import build_tokenizer

CHAT = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TEXT = {"model": TINY, "prompt": "hello", "max_tokens": 4}


@pytest.fixture(scope="module")
async def client(system: str, new_key):
    """A tenant of this module's own: its many requests must not spend the session key's per-minute limit."""
    _, key = await new_key("pro", rpm_limit=100_000, tpm_limit=100_000_000)
    async with AsyncOpenAI(base_url=f"{system}/v1", api_key=key, max_retries=0, timeout=60) as c:
        yield c


async def call(client: AsyncOpenAI, path: str, **body):
    """``body`` through the client's own method for ``path``; what it has no argument for, in extra_body."""
    create = client.chat.completions.create if "chat" in path else client.completions.create
    known = set(inspect.signature(create).parameters)
    extra = {k: v for k, v in body.items() if k not in known}
    return await create(**{k: v for k, v in body.items() if k in known}, extra_body=extra or None)


REFUSED = [
    ("/v1/chat/completions", {"foo": 1}, "foo"),
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"modalities": ["text", "audio"]}, "modalities"),
    ("/v1/chat/completions", {"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ("/v1/chat/completions", {"prediction": {"type": "content", "content": "x"}}, "prediction"),
    ("/v1/chat/completions", {"reasoning_effort": "low"}, "reasoning_effort"),
    ("/v1/chat/completions", {"verbosity": "low"}, "verbosity"),
    ("/v1/chat/completions", {"web_search_options": {}}, "web_search_options"),
    ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"function_call": "auto"}, "function_call"),
    ("/v1/chat/completions", {"prompt_cache_key": "k"}, "prompt_cache_key"),
    ("/v1/chat/completions", {"parallel_tool_calls": True}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"logit_bias": {"999999": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/chat/completions", {"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ("/v1/completions", {"suffix": "the end"}, "suffix"),
    ("/v1/completions", {"best_of": 3, "n": 4}, "best_of"),
    ("/v1/completions", {"best_of": 3, "stream": True}, "best_of"),
    ("/v1/completions", {"echo": True, "logprobs": 2}, "echo"),
    ("/v1/completions", {"service_tier": "flex"}, "service_tier"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 10**6]]}, "prompt"),
]


@pytest.mark.parametrize("path, extra, param", REFUSED, ids=[f"{p.rsplit('/', 1)[1]}-{x}" for p, _, x in REFUSED])
async def test_what_cannot_be_honoured_is_refused_by_name(client, path, extra, param):
    with pytest.raises(openai.BadRequestError) as refused:
        await call(client, path, **{**(CHAT if "chat" in path else TEXT), **extra})
    error = refused.value.body
    assert error["param"] == param or error["param"].startswith(param), error
    assert error["type"] == "invalid_request_error"


async def test_honoured_parameters_do_what_they_say(client, database_url: str):
    a = build_tokenizer().convert_tokens_to_ids("a")
    chat, text = "/v1/chat/completions", "/v1/completions"
    # logit_bias: +100 on one token makes it the only one chosen.
    biased = await call(client, chat, **CHAT, logit_bias={str(a): 100}, temperature=0, ignore_eos=True)
    assert biased.choices[0].message.content == "aaaa"
    # max_completion_tokens wins over max_tokens.
    capped = await call(client, chat, **CHAT, max_completion_tokens=2, ignore_eos=True)
    assert capped.usage.completion_tokens == 2
    # echo: the prompt, then the completion; a token-id prompt echoes its text.
    echoed = await call(client, text, **TEXT, echo=True)
    assert echoed.choices[0].text.startswith("hello")
    tokens = await call(client, text, **{**TEXT, "prompt": [a, a], "max_tokens": 1}, echo=True)
    assert tokens.choices[0].text.startswith("aa") and tokens.usage.prompt_tokens == 2
    # Several prompts: n choices each, prompt p's i-th at index p * n + i; usage over all of them.
    several = await call(client, text, **{**TEXT, "prompt": ["one", "two", "three"], "max_tokens": 3}, n=2,
                         ignore_eos=True)
    assert [c.index for c in several.choices] == list(range(6))
    assert several.usage.completion_tokens == 18
    # best_of: best_of choices are generated (and billed), the best n returned.
    best = await call(client, text, **{**TEXT, "max_tokens": 5}, n=1, best_of=3, ignore_eos=True)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 15
    # user and metadata are kept with the usage row.
    kept = await call(client, chat, **CHAT, user="end-user-7", metadata={"team": "search"}, store=False)
    # stream_options.include_obfuscation pads every chunk.
    stream = await call(client, chat, **CHAT, stream=True,
                        stream_options={"include_usage": True, "include_obfuscation": True})
    chunks = [chunk async for chunk in stream]
    assert chunks and all(getattr(c, "obfuscation", None) for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens >= 1

    conn = await asyncpg.connect(database_url)
    try:
        row = await poll(lambda: conn.fetchrow("SELECT end_user, metadata FROM requests WHERE request_id = $1",
                                               kept.id.removeprefix("chatcmpl-")),
                         lambda r: r is not None, timeout_s=30, what="the usage row")
    finally:
        await conn.close()
    assert (row["end_user"], json.loads(row["metadata"])) == ("end-user-7", {"team": "search"})
