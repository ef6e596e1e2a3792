"""Every parameter of OpenAI's chat and legacy completions requests is honoured or refused with a 400 naming it
(README, "Parameters"): nothing a client sends is silently dropped."""

from __future__ import annotations

import json

import asyncpg
import httpx
import pytest

from tests.e2e.conftest import TINY
from tests.support.system import poll
from tests.support.tiny_model import build_tokenizer

CHAT = {"model": TINY, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TEXT = {"model": TINY, "prompt": "hello", "max_tokens": 4}

@pytest.fixture(scope="module")
async def auth(new_key) -> dict[str, str]:
    """A tenant of this module's own: its many requests must not spend the session key's per-minute limit."""
    _, key = await new_key("pro", rpm_limit=100_000, tpm_limit=100_000_000)
    return {"Authorization": f"Bearer {key}"}


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
async def test_what_cannot_be_honoured_is_refused_by_name(system: str, auth: dict, path, extra, param):
    body = {**(CHAT if "chat" in path else TEXT), **extra}
    async with httpx.AsyncClient(base_url=system, headers=auth, timeout=60) as http:
        r = await http.post(path, json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param or error["param"].startswith(param), error
    assert error["type"] == "invalid_request_error"


async def test_honoured_parameters_do_what_they_say(system: str, auth: dict, database_url: str):
    a = build_tokenizer().convert_tokens_to_ids("a")
    async with httpx.AsyncClient(base_url=system, headers=auth, timeout=60) as http:
        async def ok(path: str, **body) -> dict:
            r = await http.post(path, json=body)
            assert r.status_code == 200, r.text
            return r.json()

        # logit_bias: +100 on one token makes it the only one chosen.
        biased = await ok("/v1/chat/completions", **{**CHAT, "logit_bias": {str(a): 100}, "temperature": 0,
                                                     "ignore_eos": True})
        assert biased["choices"][0]["message"]["content"] == "aaaa"
        # max_completion_tokens wins over max_tokens.
        capped = await ok("/v1/chat/completions", **{**CHAT, "max_completion_tokens": 2, "ignore_eos": True})
        assert capped["usage"]["completion_tokens"] == 2
        # echo: the prompt, then the completion; a token-id prompt echoes its text.
        echoed = await ok("/v1/completions", **{**TEXT, "echo": True})
        assert echoed["choices"][0]["text"].startswith("hello")
        tokens = await ok("/v1/completions", **{**TEXT, "prompt": [a, a], "echo": True, "max_tokens": 1})
        assert tokens["choices"][0]["text"].startswith("aa") and tokens["usage"]["prompt_tokens"] == 2
        # Several prompts: n choices each, prompt p's i-th at index p * n + i; usage over all of them.
        several = await ok("/v1/completions", **{**TEXT, "prompt": ["one", "two", "three"], "n": 2,
                                                  "ignore_eos": True, "max_tokens": 3})
        assert [c["index"] for c in several["choices"]] == list(range(6))
        assert several["usage"]["completion_tokens"] == 18
        # best_of: best_of choices are generated (and billed), the best n returned.
        best = await ok("/v1/completions", **{**TEXT, "n": 1, "best_of": 3, "ignore_eos": True, "max_tokens": 5})
        assert len(best["choices"]) == 1 and best["choices"][0]["logprobs"] is None
        assert best["usage"]["completion_tokens"] == 15
        # user and metadata are kept with the usage row.
        kept = await ok("/v1/chat/completions", **{**CHAT, "user": "end-user-7", "metadata": {"team": "search"},
                                                   "store": False})
        # stream_options.include_obfuscation pads every chunk.
        async with http.stream("POST", "/v1/chat/completions", json={
                **CHAT, "stream": True, "stream_options": {"include_usage": True, "include_obfuscation": True}}) as r:
            chunks = [json.loads(line[6:]) for line in [x async for x in r.aiter_lines()]
                      if line.startswith("data: {")]
        assert chunks and all(c.get("obfuscation") for c in chunks if c["choices"])
        assert chunks[-1]["usage"]["completion_tokens"] >= 1

    conn = await asyncpg.connect(database_url)
    try:
        row = await poll(lambda: conn.fetchrow("SELECT end_user, metadata FROM requests WHERE request_id = $1",
                                               kept["id"].removeprefix("chatcmpl-")),
                         lambda r: r is not None, timeout_s=30, what="the usage row")
    finally:
        await conn.close()
    assert (row["end_user"], json.loads(row["metadata"])) == ("end-user-7", {"team": "search"})
