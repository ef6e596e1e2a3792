"""Tenants, keys, limits, conversations and billing, end to end on real Postgres and NATS."""

from __future__ import annotations

import os
import signal
import time
import uuid

import asyncpg
import httpx
import nats
import pytest

from switchyard.deploy.services import wait_until_ready
from switchyard.shared import subjects
from switchyard.shared.messages import UsageRecord, encode
from tests.support.system import free_port, poll, wait_usage_written

MODEL = "tiny"



def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def chat_body(max_tokens: int = 4, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


@pytest.fixture(scope="module")
def second_gateway(e2e):
    """Another gateway process on the same NATS and Postgres."""
    port = free_port()
    gw = e2e.start_gateway("gateway-2", port=port)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", MODEL, timeout_s=60, watch=[gw])
        yield f"http://127.0.0.1:{port}", gw
    finally:
        gw.stop()


async def test_missing_or_wrong_key_is_401(system):
    async with httpx.AsyncClient(base_url=system) as http:
        for headers in ({}, bearer("sk-sy-wrong"), {"Authorization": "Basic abc"}):
            r = await http.post("/v1/chat/completions", json=chat_body(), headers=headers)
            assert r.status_code == 401
            assert r.json()["error"]["code"] == "invalid_api_key"
        assert (await http.get("/v1/models")).status_code == 401


async def test_revoked_key_stops_working_within_seconds(system, database_url, new_key):
    _, secret = await new_key()
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=30) as http:
        assert (await http.post("/v1/chat/completions", json=chat_body())).status_code == 200
        conn = await asyncpg.connect(database_url)
        try:
            key_id = await conn.fetchval("SELECT id FROM api_keys WHERE key_hash = sha256($1::text::bytea)", secret)
            await conn.execute("UPDATE api_keys SET revoked_at = now() WHERE id = $1", key_id)
        finally:
            await conn.close()

        async def refused():
            return (await http.get("/v1/models")).status_code == 401
        # Refused once the gateway's authentication cache lets the key go (domain/auth.CACHE_S); the deadline only
        # ends a test whose revocation never lands.
        await poll(refused, timeout_s=30, what="revocation")


async def test_rate_limit_holds_across_two_gateways(system, second_gateway, new_key):
    _, secret = await new_key(rpm_limit=3)
    other, _ = second_gateway
    codes = []
    for base in (system, other, system, other):
        async with httpx.AsyncClient(base_url=base, headers=bearer(secret), timeout=30) as http:
            r = await http.post("/v1/chat/completions", json=chat_body())
            codes.append(r.status_code)
            last = r
    # A minute boundary between the requests would reset the window and let the 4th through.
    assert codes == [200, 200, 200, 429], codes
    assert last.json()["error"]["code"] == "rate_limit_exceeded"
    assert last.headers["x-ratelimit-limit-requests"] == "3"
    assert last.headers["x-ratelimit-remaining-requests"] == "0"
    assert int(last.headers["retry-after"]) >= 1


async def test_rate_limit_headers_on_every_response_and_tokens_returned(system, new_key):
    _, secret = await new_key(tpm_limit=5000)
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=30) as http:
        r1 = await http.post("/v1/chat/completions", json=chat_body(max_tokens=2000))
        assert r1.status_code == 200
        assert r1.headers["x-ratelimit-limit-tokens"] == "5000"
        reserved_left = int(r1.headers["x-ratelimit-remaining-tokens"])
        assert reserved_left <= 5000 - 2000  # the whole max_tokens was reserved up front
        # 2000 more would not fit next to an unreturned reservation (2000 + 2000 + prompts > 5000 - 2000 used).
        r2 = await http.post("/v1/chat/completions", json=chat_body(max_tokens=2000))
        assert r2.status_code == 200, r2.text
        used = r1.json()["usage"]["total_tokens"]
        # After r1 settled, its unused reservation came back: remaining counts r1's real use, not its reservation.
        assert int(r2.headers["x-ratelimit-remaining-tokens"]) > 5000 - 2000 - 2000 - 100
        assert used < 2100


async def test_the_reservation_counts_every_choice_and_use_beyond_it_is_charged(system, new_key, database_url):
    _, secret = await new_key(tpm_limit=1000)
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=30) as http:
        # n=4 x 300 tokens may use 1200: over the limit before anything runs (one choice's 300 would fit).
        r = await http.post("/v1/chat/completions", json=chat_body(max_tokens=300, n=4))
        assert r.status_code == 429 and "may use up to" in r.json()["error"]["message"], r.text
        assert (await http.post("/v1/chat/completions", json=chat_body(max_tokens=300))).status_code == 200

    _, secret = await new_key(tpm_limit=10**6)
    # 150 three-byte characters: the tiny byte-level tokenizer makes several tokens of each, far more than the
    # ~4 characters a token the reservation assumed. The window must end up holding what was really used.
    body = {**chat_body(max_tokens=2), "messages": [{"role": "user", "content": "語" * 150}]}
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=30) as http:
        r = await http.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        used = r.json()["usage"]["total_tokens"]
        assert used > 150 // 4 + 2 + 100, "the prompt really costs more than its reservation"

        async def window_tokens() -> int:
            conn = await asyncpg.connect(database_url)
            try:
                return await conn.fetchval(
                    "SELECT sum(w.tokens) FROM rate_windows w JOIN api_keys k ON k.id = w.key_id "
                    "JOIN tenants t ON t.id = k.tenant_id WHERE k.key_hash = sha256($1::bytea)", secret.encode())
            finally:
                await conn.close()
        assert await poll(window_tokens, lambda t: t == used, what="the window to hold the real use") == used


async def test_monthly_budget_exhausted_is_insufficient_quota(system, new_key):
    _, secret = await new_key(monthly_token_budget=30)
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=30) as http:
        # What it may use (~12 tokens reserved) fits; what it really used (its prompt is longer than ~4 characters a
        # token) is billed, and spends the rest.
        assert (await http.post("/v1/chat/completions", json=chat_body(max_tokens=10))).status_code == 200

        async def over_budget():
            r = await http.post("/v1/chat/completions", json=chat_body(max_tokens=1))
            return r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
        await poll(over_budget, what="quota exhaustion")


async def test_the_prefix_cache_never_tells_one_tenant_about_anothers_prompt(system, new_key):
    """Tenant A's long confidential system prompt is cached for A; B sending the very same text, or C a guess that
    differs in one late word, computes it all and sees cached_tokens 0."""
    _, a = await new_key()
    _, b = await new_key()
    _, c = await new_key()
    secret = " ".join(f"secret{i}" for i in range(150))

    def body(system_prompt: str) -> dict:
        return {**chat_body(max_tokens=2), "messages": [{"role": "system", "content": system_prompt},
                                                        {"role": "user", "content": "hello"}]}

    async with httpx.AsyncClient(base_url=system, timeout=30) as http:
        async def cached(key: str, system_prompt: str) -> tuple[int, int]:
            r = await http.post("/v1/chat/completions", json=body(system_prompt), headers=bearer(key))
            assert r.status_code == 200, r.text
            usage = r.json()["usage"]
            return usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]

        prompt_tokens, _ = await cached(a, secret)
        assert prompt_tokens > 64
        assert (await cached(a, secret))[1] >= 64, "A's own second request finds A's prompt cached"
        assert (await cached(b, secret))[1] == 0
        assert (await cached(c, secret.replace("secret140", "guess140")))[1] == 0, "a guess right up to word 140"
        assert (await cached(b, secret))[1] >= 64, "B's own blocks are B's to reuse"


async def test_usage_is_per_tenant(system, new_key):
    _, a = await new_key()
    _, b = await new_key()
    async with httpx.AsyncClient(base_url=system, timeout=30) as http:
        r = await http.post("/v1/chat/completions", json=chat_body(max_tokens=3), headers=bearer(a))
        assert r.status_code == 200

        async def billed():
            body = (await http.get("/v1/usage", headers=bearer(a))).json()
            return body["data"] if body["data"] and body["data"][0]["completion_tokens"] == 3 else None
        rows = await poll(billed, what="billing row")
        assert rows[0]["model"] == MODEL and rows[0]["requests"] == 1 and rows[0]["cost_usd"] > 0
        assert (await http.get("/v1/usage", headers=bearer(b))).json()["data"] == []


async def test_redelivered_usage_records_are_absorbed(e2e, nats_url, database_url):
    # The same record three times under distinct message ids (JetStream's dedupe does not hide these): the writer
    # must ack every copy (none left to redeliver forever) and bill the request as the record says.
    record = UsageRecord(request_id=uuid.uuid4().hex, model=MODEL, tier="pro", prompt_tokens=7,
                         completion_tokens=3, finish_reason="stop", created_at=time.time(), queue_ms=1.0,
                         first_token_ms=2.0, total_ms=3.0)
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        for attempt in range(3):
            await js.publish(subjects.USAGE_SUBJECT, encode(record), headers={"Nats-Msg-Id": f"dup-{attempt}-"
                                                                                         f"{record.request_id}"})
    finally:
        await nc.close()
    await wait_usage_written(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT prompt_tokens, completion_tokens, finish_reason FROM requests "
                                  "WHERE request_id = $1", record.request_id)
        assert tuple(row) == (7, 3, "stop")
    finally:
        await conn.close()


async def test_usage_survives_a_gateway_killed_mid_stream(e2e, second_gateway, database_url, api_key):
    base, gw = second_gateway
    async with httpx.AsyncClient(base_url=base, headers=bearer(api_key), timeout=30) as http:
        async with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=300, stream=True)) as r:
            request_id = r.headers["x-request-id"]
            async for line in r.aiter_lines():
                if '"content"' in line:
                    break
            os.kill(gw.pid, signal.SIGKILL)  # no cancel is sent: the worker finishes and bills the request
    conn = await asyncpg.connect(database_url)
    try:
        async def row():
            return await conn.fetchrow("SELECT * FROM requests WHERE request_id = $1", request_id)
        billed = await poll(row, what="billing row of the killed gateway's request")
        assert billed["completion_tokens"] == 300 and billed["finish_reason"] == "length"
    finally:
        await conn.close()


async def test_conversation_round_trip_isolation_and_truncation(system, new_key):
    _, a = await new_key()
    _, b = await new_key()
    async with httpx.AsyncClient(base_url=system, timeout=60) as http:
        conv = (await http.post("/v1/conversations", json={"model": MODEL, "system": "Be terse.",
                                                            "metadata": {"topic": "trains"}},
                                headers=bearer(a))).json()
        cid = conv["id"]
        assert conv["object"] == "conversation" and conv["metadata"] == {"topic": "trains"}

        # Other tenants see nothing: 404, as if it did not exist.
        for method, path in (("GET", f"/v1/conversations/{cid}"), ("GET", f"/v1/conversations/{cid}/messages"),
                             ("DELETE", f"/v1/conversations/{cid}")):
            r = await http.request(method, path, headers=bearer(b))
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"

        r = await http.post(f"/v1/conversations/{cid}/messages", headers=bearer(a),
                            json={"content": "first " * 10, "max_tokens": 5, "ignore_eos": True, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["dropped_messages"] == 0
        # A streamed turn works too and is stored when it ends.
        async with http.stream("POST", f"/v1/conversations/{cid}/messages", headers=bearer(a),
                               json={"content": "second", "max_tokens": 5, "ignore_eos": True, "stream": True}) as s:
            assert s.status_code == 200
            assert [line async for line in s.aiter_lines() if line.startswith("data: ")][-1] == "data: [DONE]"

        msgs = (await http.get(f"/v1/conversations/{cid}/messages", headers=bearer(a))).json()
        assert [m["role"] for m in msgs["data"]] == ["user", "assistant", "user", "assistant"]
        assert msgs["data"][0]["content"] == "first " * 10
        page = (await http.get(f"/v1/conversations/{cid}/messages?limit=3", headers=bearer(a))).json()
        assert page["has_more"] and len(page["data"]) == 3
        rest = (await http.get(f"/v1/conversations/{cid}/messages?after={page['last_id']}",
                               headers=bearer(a))).json()
        assert [m["id"] for m in rest["data"]] == [msgs["data"][3]["id"]] and not rest["has_more"]

        # A turn whose history no longer fits the context drops the oldest turns, keeping the system prompt.
        big = "x" * 3000  # ~3000 byte-level tokens of the 4096-token test model
        r = await http.post(f"/v1/conversations/{cid}/messages", headers=bearer(a),
                            json={"content": big, "max_tokens": 1000, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["dropped_messages"] > 0
        assert int(r.headers["x-switchyard-dropped-messages"]) == r.json()["dropped_messages"]

        assert (await http.delete(f"/v1/conversations/{cid}", headers=bearer(a))).json()["deleted"] is True
        assert (await http.get(f"/v1/conversations/{cid}", headers=bearer(a))).status_code == 404
