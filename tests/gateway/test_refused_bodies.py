"""What a key's refused bodies may cost a gateway (gateway/refused_bodies.py), without servers: the bytes of bodies
read and answered 4xx count for a minute; past the budget the key's requests are answered 429 with Retry-After,
their bodies never read; other keys, and what was answered well, are untouched."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from switchyard.gateway import refused_bodies
from switchyard.gateway.refused_bodies import RefusedBodies, RefusedBytes
from switchyard.shared.tenant_state import TenantStateCollector


def test_refused_bytes_count_for_a_minute_and_say_when_there_is_room_again():
    budget = RefusedBytes(per_minute=100)
    budget.refused("k", 60, now=0.0)
    assert budget.wait_s("k", now=1.0) is None
    budget.refused("k", 50, now=10.0)
    assert budget.wait_s("k", now=11.0) == pytest.approx(49.0)  # once the first 60 leave, at 60 s
    assert budget.wait_s("other", now=11.0) is None
    assert budget.wait_s("k", now=60.5) is None  # 50 left in the window
    assert budget.wait_s("k", now=71.0) is None and budget.wait_s("k", now=71.0) is None  # all gone, forgotten


def test_keys_that_stopped_calling_are_forgotten_once_their_refusals_leave_the_window():
    budget = RefusedBytes(per_minute=100)
    for key in ("gone", "staying"):
        budget.refused(key, 10, now=0.0)
    budget.refused("staying", 10, now=50.0)
    assert budget.wait_s("anyone", now=70.0) is None  # any key's request sweeps, once a window
    assert set(budget._refused) == set(budget._sums) == {"staying"}
    assert budget.wait_s("anyone", now=130.0) is None
    assert budget._refused == {} and budget._sums == {}


def gateway_metrics(errors: list) -> SimpleNamespace:
    """The gateway's metrics as the middleware uses them: its errors recorded in ``errors``, its state watched."""
    return SimpleNamespace(error=lambda *args: errors.append(args), tenant_state=TenantStateCollector())


class App:
    """Test double of the application: reads the whole body, then answers ``status``."""

    def __init__(self, status: int) -> None:
        self.status, self.calls = status, 0

    async def __call__(self, scope, receive, send) -> None:
        self.calls += 1
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": self.status, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


async def call(middleware, key: str, body: bytes) -> tuple[int, dict, int]:
    """(status, headers, bytes of the body the app was handed) of one request of ``key``."""
    chunks = [body[i:i + 1000] for i in range(0, len(body), 1000)] or [b""]
    handed, sent = 0, []

    async def receive():
        nonlocal handed
        chunk = chunks.pop(0)
        handed += len(chunk)
        return {"type": "http.request", "body": chunk, "more_body": bool(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/v1/chat/completions", "state": {"auth": SimpleNamespace(key_id=key)}}
    await middleware(scope, receive, send)
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}, handed


async def test_a_key_past_its_budget_is_answered_429_unread_and_other_keys_are_untouched(monkeypatch):
    monkeypatch.setattr(refused_bodies, "PAUSE_S", 0.0)
    errors = []
    metrics = gateway_metrics(errors)
    refusing = App(400)
    middleware = RefusedBodies(refusing, per_minute=5000, metrics=metrics)
    body = b"x" * 2500
    assert (await call(middleware, "hostile", body))[0] == 400
    assert (await call(middleware, "hostile", body))[0] == 400  # 5,000 bytes refused: the budget is spent
    status, headers, handed = await call(middleware, "hostile", body)
    assert status == 429 and handed == 0 and refusing.calls == 2  # neither read nor passed on
    assert 1 <= int(headers["retry-after"]) <= 60
    assert errors == [(None, None, 429, "too_many_refused_bodies")]
    assert (await call(middleware, "other", body))[0] == 400  # another key's budget is its own


async def test_bodies_answered_well_cost_nothing_and_the_429_is_openai_shaped(monkeypatch):
    monkeypatch.setattr(refused_bodies, "PAUSE_S", 0.0)
    middleware = RefusedBodies(App(200), per_minute=10, metrics=gateway_metrics([]))
    for _ in range(3):
        assert (await call(middleware, "k", b"y" * 100))[0] == 200
    sent = []

    async def send(message):
        sent.append(message)

    spent = RefusedBodies(App(400), per_minute=10, metrics=gateway_metrics([]))
    await call(spent, "k", b"z" * 20)
    scope = {"type": "http", "path": "/v1/responses", "state": {"auth": SimpleNamespace(key_id="k")}}
    await spent(scope, None, send)
    error = json.loads(sent[1]["body"])["error"]
    assert error["code"] == "too_many_refused_bodies" and error["type"] == "rate_limit_error"


async def test_the_keys_counted_are_on_the_tenant_state_gauge(monkeypatch):
    monkeypatch.setattr(refused_bodies, "PAUSE_S", 0.0)
    metrics = gateway_metrics([])
    middleware = RefusedBodies(App(400), per_minute=5000, metrics=metrics)
    for key in ("a", "b"):
        await call(middleware, key, b"x" * 10)
    [family] = metrics.tenant_state.collect()
    assert [(s.labels, s.value) for s in family.samples] == [({"structure": "refused_body_keys"}, 2)]
