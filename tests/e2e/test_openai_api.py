"""End to end through the official openai client: gateway → JetStream → worker (tiny model) → SSE back."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import openai
import pytest

from tests.support.system import poll

TINY = "tiny"  # the name the e2e worker serves the tiny model as (see conftest)

PROMPT = [{"role": "user", "content": "Tell me a story about a train yard."}]


def greedy(client, **kw):
    return client.chat.completions.create(model=TINY, messages=PROMPT, temperature=0, **kw)


def test_models_lists_the_served_model(client):
    ids = [m.id for m in client.models.list().data]
    assert TINY in ids


def test_chat_non_streaming(client):
    r = greedy(client, max_tokens=12, extra_body={"ignore_eos": True})
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str) and r.choices[0].message.content
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 12
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 12


def test_chat_streaming_matches_non_streaming_and_reports_usage(client):
    full = greedy(client, max_tokens=16, extra_body={"ignore_eos": True})
    chunks = list(greedy(client, max_tokens=16, stream=True, stream_options={"include_usage": True},
                         extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_streaming_and_not(client):
    r = client.completions.create(model=TINY, prompt="Once upon a time", max_tokens=8, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert r.object == "text_completion" and r.usage.completion_tokens == 8
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=TINY, prompt="Once upon a time", max_tokens=8, temperature=0, stream=True,
        extra_body={"ignore_eos": True}) if c.choices)
    assert streamed == r.choices[0].text


def test_stop_sequence_cuts_the_output_before_it(client):
    text = greedy(client, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(text) >= 6, text
    stop = text[3:6]
    expected = text[: text.index(stop)]
    r = greedy(client, max_tokens=24, stop=[stop], extra_body={"ignore_eos": True})
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == expected


def test_unknown_model_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=PROMPT)
    assert info.value.code == "model_not_found"


@pytest.mark.parametrize("body", [
    b"{not json",
    b'{"model": "tiny"}',
    b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": 7}',
    b'{"model": "tiny", "messages": []}',
])
def test_malformed_body_is_400_with_openai_error_shape(system, auth, body):
    r = httpx.post(f"{system}/v1/chat/completions", content=body, headers={"Content-Type": "application/json", **auth})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error" and err["message"]


@pytest.mark.parametrize("chunked", [False, True], ids=["content-length", "chunked"])
def test_a_body_over_the_limit_is_413_before_it_is_parsed(system, auth, chunked):
    big = b'{"model": "tiny", "messages": [{"role": "user", "content": "' + b"x" * (5 * 2**20) + b'"}]}'
    content = (big[i:i + 2**16] for i in range(0, len(big), 2**16)) if chunked else big
    r = httpx.post(f"{system}/v1/chat/completions", content=content,
                   headers={"Content-Type": "application/json", **auth}, timeout=30)
    assert r.status_code == 413
    assert r.json()["error"]["code"] == "request_too_large" and "4194304 bytes" in r.json()["error"]["message"]


def test_a_prompt_too_large_for_one_queue_message_is_413_and_the_gateway_goes_on(client, system, auth):
    """1.1 MB: under the 4 MiB body limit, over NATS's 1 MiB max_payload."""
    with pytest.raises(openai.APIStatusError) as info:
        client.completions.create(model=TINY, prompt="word " * 230_000, max_tokens=4)
    assert info.value.status_code == 413 and info.value.code == "request_too_large"
    assert "once encoded" in info.value.message
    assert greedy(client, max_tokens=3).choices[0].message.content is not None


def test_prompt_over_context_is_400_context_length_exceeded(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=TINY, prompt="word " * 4000, max_tokens=4)
    assert info.value.code == "context_length_exceeded"


async def _request_row(database_url: str, request_id: str, timeout_s: float = 20.0):
    """Poll until the usage writer has recorded ``request_id`` (it is asynchronous by design)."""
    conn = await asyncpg.connect(database_url)
    try:
        return await poll(lambda: conn.fetchrow("SELECT * FROM requests WHERE request_id = $1", request_id),
                          lambda row: row is not None, timeout_s, what=f"a usage row for {request_id}")
    finally:
        await conn.close()


async def test_finished_request_is_recorded_in_postgres(client, database_url):
    r = await asyncio.to_thread(greedy, client, max_tokens=5, extra_body={"ignore_eos": True})
    request_id = r.id.removeprefix("chatcmpl-")
    row = await _request_row(database_url, request_id)
    assert row["completion_tokens"] == 5 and row["prompt_tokens"] == r.usage.prompt_tokens
    assert row["finish_reason"] == "length" and row["model"] == TINY
    assert row["total_ms"] >= row["queue_ms"] >= 0


async def test_closing_a_stream_cancels_generation_on_the_worker(system, auth, database_url):
    body = {"model": TINY, "messages": PROMPT, "max_tokens": 3000, "stream": True, "ignore_eos": True,
            "temperature": 0}
    async with httpx.AsyncClient(timeout=60, headers=auth) as http:
        async with http.stream("POST", f"{system}/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            request_id = resp.headers["x-request-id"]
            seen = 0
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and '"content"' in line:
                    seen += 1
                if seen >= 3:
                    break  # leaving the block closes the connection mid-stream
    row = await _request_row(database_url, request_id)
    assert row["finish_reason"] == "cancelled"
    assert row["completion_tokens"] < 3000


def test_chat_logprobs_streamed_and_not(client):
    kw = dict(max_tokens=6, logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    full = greedy(client, **kw)
    content = full.choices[0].logprobs.content
    assert len(content) == 6  # (the random tiny model's bytes need not spell valid UTF-8 token by token)
    for t in content:
        assert t.logprob <= 0 and t.bytes == list(t.token.encode())
        assert len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
        assert t.logprob == t.top_logprobs[0].logprob  # greedy: the chosen token is the most likely
    streamed = [tok for c in greedy(client, stream=True, **kw) if c.choices and c.choices[0].logprobs
                for tok in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    # Equal up to float rounding: the two runs may share their steps with other requests (other matmul shapes).
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)
    assert greedy(client, max_tokens=3).choices[0].logprobs is None  # not asked for, not sent


def test_completions_logprobs(client):
    r = client.completions.create(model=TINY, prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=3,
                                  extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    # Greedy: nothing in the top 3 beats the chosen token (tokens with equal text share one key, so <= 3).
    assert all(1 <= len(top) <= 3 and max(top.values()) <= lp.token_logprobs[i] + 1e-6
               for i, top in enumerate(lp.top_logprobs))
