"""One admission path for every route and tier, tried as a hostile tenant would: flex does not skip the key's
limits, every route counts against the request rate, a tenant's concurrent requests and sequences are capped, and
the monthly budget reserves, so a burst cannot overrun it."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import pytest

from tests.support.system import poll

MODEL = "tiny"


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def chat_body(max_tokens: int = 2, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


async def test_flex_is_held_to_the_keys_own_limits(system, new_key):
    """Flex runs on the batch tier, whose policy has no rpm/tpm: the key's own still apply."""
    _, secret = await new_key("pro", rpm_limit=2, tpm_limit=10_000)
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=60) as http:
        huge = await http.post("/v1/chat/completions", json=chat_body(n=16, max_tokens=2_000_000_000,
                                                                      service_tier="flex"))
        assert huge.status_code == 429 and huge.json()["error"]["code"] == "rate_limit_exceeded", huge.text
        assert "may use up to" in huge.json()["error"]["message"]
        codes = [(await http.post("/v1/chat/completions", json=chat_body(service_tier="flex"))).status_code
                 for _ in range(3)]
    assert codes == [200, 200, 429], codes


async def test_flex_is_held_to_the_tiers_limits_of_the_keys_tenant(system, new_key):
    """A free tenant (tier tpm 40 000): n=16 x 2e9 tokens, 429 on the default tier, is 429 on flex too."""
    _, secret = await new_key("free")
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=60) as http:
        for tier in (None, "flex"):
            extra = {"service_tier": tier} if tier else {}
            r = await http.post("/v1/chat/completions", json=chat_body(n=16, max_tokens=2_000_000_000, **extra))
            assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", (tier, r.text)
            assert r.headers["x-ratelimit-limit-tokens"] == "40000"


@pytest.mark.parametrize("route", ["files", "batches", "usage", "conversations", "models", "responses"])
async def test_every_route_counts_against_the_keys_request_rate(system, new_key, route):
    _, secret = await new_key("pro", rpm_limit=3)
    calls = {
        "files": lambda http: http.get("/v1/files"),
        "batches": lambda http: http.get("/v1/batches"),
        "usage": lambda http: http.get("/v1/usage"),
        "conversations": lambda http: http.post("/v1/conversations", json={"model": MODEL}),
        "models": lambda http: http.get("/v1/models"),
        "responses": lambda http: http.get("/v1/responses/resp_nobody_made"),  # counted before the lookup
    }
    ok = 404 if route == "responses" else 200
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=30) as http:
        answers = [await calls[route](http) for _ in range(4)]
    assert [r.status_code for r in answers] == [ok, ok, ok, 429], [r.text for r in answers]
    assert answers[0].headers["x-ratelimit-limit-requests"] == "3"
    assert answers[-1].json()["error"]["code"] == "rate_limit_exceeded" and int(answers[-1].headers["retry-after"])


async def test_a_tenants_concurrent_requests_are_capped_and_freed_when_they_end(system, new_key):
    _, secret = await new_key("pro", max_streams=2)
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=60) as http:
        body = chat_body(max_tokens=3000, stream=True)
        async with http.stream("POST", "/v1/chat/completions", json=body) as first, \
                http.stream("POST", "/v1/chat/completions", json=body) as second:
            assert (first.status_code, second.status_code) == (200, 200)
            third = await http.post("/v1/chat/completions", json=chat_body())
            assert third.status_code == 429, third.text
            assert third.json()["error"]["code"] == "concurrency_limit_exceeded"
            assert int(third.headers["retry-after"]) >= 1
            # Not streamed, nor a conversation turn, makes no difference: a request generating is one.
            conv = (await http.post("/v1/conversations", json={"model": MODEL})).json()["id"]
            turn = await http.post(f"/v1/conversations/{conv}/messages", json={"content": "hi", "max_tokens": 2})
            assert turn.status_code == 429 and turn.json()["error"]["code"] == "concurrency_limit_exceeded"
        # Both streams closed (the client went away): their seats are free again.

        async def admitted():
            return await http.post("/v1/chat/completions", json=chat_body())
        await poll(admitted, lambda r: r.status_code == 200, timeout_s=10,
                   what=lambda r: f"a seat freed by the closed streams: {r.status_code} {r.text}")


async def test_a_tenants_sequences_are_capped(system, new_key):
    _, secret = await new_key("pro", max_sequences=3)
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=60) as http:
        never = await http.post("/v1/chat/completions", json=chat_body(n=4))
        assert never.status_code == 429 and never.json()["error"]["param"] == "n", never.text
        async with http.stream("POST", "/v1/chat/completions", json=chat_body(max_tokens=3000, n=2, stream=True)) \
                as running:
            assert running.status_code == 200
            over = await http.post("/v1/chat/completions", json=chat_body(n=2))
            assert over.status_code == 429 and over.json()["error"]["code"] == "concurrency_limit_exceeded"
            fits = await http.post("/v1/chat/completions", json=chat_body(n=1))
            assert fits.status_code == 200, fits.text


async def test_the_monthly_budget_reserves_so_a_burst_cannot_overrun_it(system, new_key, database_url):
    """Budget 100 tokens, eight requests at once that may use ~42 each: at most two fit (the budget was once
    checked against a total cached for 5 s, and all eight ran)."""
    tenant, secret = await new_key("pro", monthly_token_budget=100, rpm_limit=10**6, tpm_limit=10**9)
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=60) as http:
        answers = await asyncio.gather(*(http.post("/v1/chat/completions", json=chat_body(max_tokens=40))
                                         for _ in range(8)))
    codes = [r.status_code for r in answers]
    assert 1 <= codes.count(200) <= 2 and codes.count(429) == 8 - codes.count(200), codes
    assert all(r.json()["error"]["code"] == "insufficient_quota" for r in answers if r.status_code == 429)
    conn = await asyncpg.connect(database_url)
    try:
        async def reserved():
            return await conn.fetchval("SELECT b.reserved FROM budget_months b JOIN tenants t ON t.id = b.tenant_id "
                                       "WHERE t.name = $1", tenant)
        # Every reservation went back once its request ended (its tokens arrive as billed).
        assert await poll(reserved, lambda r: r == 0, what="reservations released") == 0
    finally:
        await conn.close()
