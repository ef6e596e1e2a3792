"""Bounded work per request, tried as a hostile tenant would: what a request may ask for is capped before it is queued
(messages or a response's input items, stop strings, schemas, a conversation's history), a grammar that exhausts the
worker's compile budget is a 400, and a tenant whose prompts are slow to prepare (a huge schema, thousands of
messages) delays itself, not another tenant: the victim's requests are served while the attacker's slow ones are
still in progress (tests/support/slow_prompts.py; bench/hostile.py times the victim's first tokens idle and
attacked)."""

from __future__ import annotations

import os
import time

import asyncpg
import httpx
import pytest

from switchyard.deploy.services import wait_until_ready
from tests.support.slow_prompts import ATTACKS, bearer, chat_body, heavy_schema, measure_pairs, with_schema
from tests.support.system import free_port

MODEL = "tiny"
FAIR = "tiny-fair"  # this module's own worker: its latencies are this module's alone
PAIRS = 12


@pytest.fixture(scope="module")
async def tenant(system, new_key):
    _, secret = await new_key("pro", rpm_limit=10**6, tpm_limit=10**9)
    async with httpx.AsyncClient(base_url=system, headers=bearer(secret), timeout=60) as http:
        yield http


async def test_what_a_request_may_ask_for_is_bounded_before_it_is_queued(tenant):
    cases = [
        (chat_body(MODEL, messages=[{"role": "user", "content": "hi"}] * 15_000), "messages",
         "array_above_max_length"),
        (chat_body(MODEL, stop="x" * 1_000_000), "stop", "invalid_value"),
        ({"model": MODEL, "prompt": "hi", "stop": ["y" * 2000]}, "stop", "invalid_value"),
        (with_schema(heavy_schema(0), MODEL), "response_format", "invalid_value"),
        (chat_body(MODEL, tools=[{"type": "function", "function": {"name": f"f{i}",
                                                                   "parameters": heavy_schema(i, 1000)}}
                                 for i in range(2)]), "tools", "invalid_value"),
        ({"model": MODEL, "input": [{"role": "user", "content": "hi"}] * 15_000}, "input",
         "array_above_max_length"),
        ({"model": MODEL, "input": "hi", "text": {"format": {"type": "json_schema", "name": "s",
                                                             "schema": heavy_schema(0)}}},
         "text.format", "invalid_value"),
    ]
    for body, param, code in cases:
        path = "/v1/completions" if "prompt" in body else "/v1/responses" if "input" in body \
            else "/v1/chat/completions"
        r = await tenant.post(path, json=body)
        assert r.status_code == 400, (param, r.text[:300])
        assert (r.json()["error"]["param"], r.json()["error"]["code"]) == (param, code), r.text[:300]
    # At the bounds themselves, all is well.
    ok = await tenant.post("/v1/chat/completions", json=chat_body(MODEL, stop="z" * 1024,
                                                                  messages=[{"role": "user", "content": "hi"}] * 8))
    assert ok.status_code == 200, ok.text


async def test_a_body_far_over_a_bound_is_refused_before_it_is_validated(tenant):
    """Refusing 15,000 messages or a 700 KB schema must not cost the gateway's event loop what validating them
    into models would (every other request waits on it): the bounds are read off the JSON first. Shown by a body
    that is also invalid elsewhere: validation would name that field; the bound is what answers."""
    for body, param in ((chat_body(MODEL, messages=[{"role": "user", "content": "hi"}] * 15_000), "messages"),
                        (with_schema(heavy_schema(0), MODEL), "response_format")):
        r = await tenant.post("/v1/chat/completions", json={**body, "temperature": "hot"})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text[:300]
    r = await tenant.post("/v1/chat/completions", json={**chat_body(MODEL), "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature", r.text[:300]  # within: validated


async def test_a_conversations_history_is_loaded_within_its_bounds(tenant, database_url):
    """5000 stored messages: a turn reads the newest 1000 (gateway.limits.max_history_messages), and says how many
    were left out, instead of loading them all and trimming them one render at a time."""
    conv = (await tenant.post("/v1/conversations", json={"model": MODEL, "system": "be brief"})).json()["id"]
    conn = await asyncpg.connect(database_url)
    try:
        await conn.executemany(
            "INSERT INTO conversation_messages (id, conversation_id, role, content, status) "
            "VALUES ($1, $2, $3, $4::json, 'completed')",
            [(f"msg_{conv}_{i}", conv, "user" if i % 2 == 0 else "assistant", f'"m{i}"') for i in range(5000)])
    finally:
        await conn.close()
    t0 = time.monotonic()
    r = await tenant.post(f"/v1/conversations/{conv}/messages", json={"content": "and now?", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["dropped_messages"] >= 4000 and int(r.headers["x-switchyard-dropped-messages"]) >= 4000
    assert time.monotonic() - t0 < 30


@pytest.fixture(scope="module")
async def fair(e2e, new_key):
    """A worker of its own, a victim on the session's gateway, and an attacker on a gateway of its own that lets
    schemas of any size through: what is tested is the worker both share. (A gateway's event loop pays to parse
    what it is sent, at most ``max_request_bytes`` a request, and gateways scale out on machines of their own; here
    every process shares two cores, so the attacker's gateway runs at a lower CPU priority to stand in for that.)"""
    worker = e2e.start_worker(FAIR, max_num_seqs=4)
    port = free_port()
    limits = e2e.config.gateway.limits.model_copy(update={"max_schema_bytes": 4_000_000})
    # Its refusals (grammars out of fuel) do not throttle the attacker here: what is tested is the worker.
    gateway = e2e.start_gateway("gateway-fair", port=port, run_jobs=False, limits=limits,
                                refused_body_bytes_per_minute=1 << 40)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base, FAIR, timeout_s=120, watch=[worker, gateway])
        os.setpriority(os.PRIO_PROCESS, gateway.pid, 10)
        _, victim = await new_key("pro", rpm_limit=10**6, tpm_limit=10**9)
        _, attacker = await new_key("pro", rpm_limit=10**6, tpm_limit=10**9)
        async with httpx.AsyncClient(base_url=e2e.base_url, headers=bearer(victim), timeout=120) as v, \
                httpx.AsyncClient(base_url=base, headers=bearer(attacker), timeout=120) as a:
            yield v, a
    finally:
        gateway.stop()
        worker.stop()


async def test_a_grammar_that_runs_out_of_fuel_is_a_400(fair):
    _, attacker = fair
    t0 = time.monotonic()
    r = await attacker.post("/v1/chat/completions", json=with_schema(heavy_schema(1), FAIR))
    assert r.status_code == 400, r.text[:300]
    error = r.json()["error"]
    assert error["param"] == "response_format" and "too complex" in error["message"], error
    assert time.monotonic() - t0 < 30


@pytest.mark.parametrize("attack", list(ATTACKS))
async def test_a_tenants_slow_prompts_delay_that_tenant_not_others(fair, attack):
    """While every attacker loop has a slow request in flight (a schema compiling for seconds, 2048 messages to
    render), the victim's requests are served: they start and end inside an attacker request's span (a victim
    request takes tens of milliseconds, an attacker's from a third of a second to seconds), where a worker that
    prepared in arrival order would have made them wait for the attacker's. How long they take is bench/hostile.py's
    to measure, not a test's on a shared machine."""
    victim, attacker = fair
    pairs = await measure_pairs(victim, attacker, FAIR, attack, PAIRS)
    assert len(pairs.attacked) == len(pairs.idle) == PAIRS
    assert pairs.inside() >= PAIRS // 2, (pairs.inside(), sorted(round(e - s, 3) for s, e in pairs.attacks),
                                         [round(e - s, 3) for s, _, e in pairs.attacked])


async def test_a_key_whose_bodies_keep_being_refused_is_refused_unread_and_others_are_served(e2e, new_key):
    """Refused bodies cost the gateway their decoding and nothing else counts them (they are not billed nor
    admitted): past a key's budget of refused bytes for the minute (here 1 MiB), its next requests get 429 with
    Retry-After before their bodies are read; another tenant on the same gateway is served all along."""
    port = free_port()
    gateway = e2e.start_gateway("gateway-refusals", port=port, run_jobs=False,
                                refused_body_bytes_per_minute=1 << 20)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_ready(base, MODEL, timeout_s=120, watch=[gateway])
        _, hostile = await new_key("pro", rpm_limit=10**6, tpm_limit=10**9)
        _, other = await new_key("pro", rpm_limit=10**6, tpm_limit=10**9)
        oversized = chat_body(MODEL, messages=[{"role": "user", "content": "hi"}] * 15_000)  # about 500 KB
        async with httpx.AsyncClient(base_url=base, timeout=60) as http:
            answers = []
            for _ in range(4):
                r = await http.post("/v1/chat/completions", json=oversized, headers=bearer(hostile))
                answers.append(r.status_code)
                if r.status_code == 429:
                    break
                ok = await http.post("/v1/chat/completions", json=chat_body(MODEL), headers=bearer(other))
                assert ok.status_code == 200, ok.text
            assert answers[:2] == [400, 400] and answers[-1] == 429, answers  # 1 MiB is two refusals and a bit
            assert r.json()["error"]["code"] == "too_many_refused_bodies" and int(r.headers["retry-after"]) >= 1
            small = await http.post("/v1/chat/completions", json=chat_body(MODEL), headers=bearer(hostile))
            assert small.status_code == 429  # the key waits, whatever it sends
            ok = await http.post("/v1/chat/completions", json=chat_body(MODEL), headers=bearer(other))
            assert ok.status_code == 200, ok.text
    finally:
        gateway.stop()
