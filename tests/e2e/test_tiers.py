"""Tiers under overload, end to end: JetStream-enforced queue caps (429), live limit changes, queue timeouts,
and a free-tier flood that pro requests get through, with every accepted request accounted for.

A dedicated worker runs one sequence at a time, and a long "hog" request keeps it busy, so later requests
really queue in JetStream while a test looks at them.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.support.system import poll

ADMIN_KEY = "test-admin-key"  # the gateway's admin key (see conftest)
MODEL = "tiny-tiers"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def tiers_model(e2e, auth):
    """A worker for MODEL with a single slot; tier policies are restored afterwards."""
    from switchyard.deploy.services import wait_until_ready

    worker = e2e.start_worker(MODEL, max_num_seqs=1)
    wait_until_ready(e2e.base_url, MODEL, timeout_s=120, watch=[worker])
    original = {r["tier"]: r for r in httpx.get(f"{e2e.base_url}/admin/tiers", headers=ADMIN).json()["data"]
                if r["model"] == MODEL}
    yield e2e.base_url, auth
    for tier, row in original.items():
        httpx.put(f"{e2e.base_url}/admin/tiers/{tier}", headers=ADMIN, json={
            "max_queued": row["max_queued"], "max_wait_s": row["max_wait_s"], "weight": row["weight"],
            "max_queued_per_tenant": 0})
    worker.stop()


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}


async def set_tier(http: httpx.AsyncClient, tier: str, **policy) -> None:
    """These tests are about a tier's cap, sent by one tenant: that tenant may fill it (tenant caps:
    test_fair_share.py)."""
    if "max_queued" in policy:
        policy.setdefault("max_queued_per_tenant", policy["max_queued"])
    r = await http.put(f"/admin/tiers/{tier}", headers=ADMIN, json=policy)
    assert r.status_code == 200, r.text


async def queued(http: httpx.AsyncClient, tier: str) -> int:
    rows = (await http.get("/admin/tiers", headers=ADMIN)).json()["data"]
    return next(r["queued"] for r in rows if r["model"] == MODEL and r["tier"] == tier)


async def wait_queued(http: httpx.AsyncClient, tier: str, n: int, timeout_s: float = 20) -> None:
    await poll(lambda: queued(http, tier), lambda got: got == n, timeout_s, interval_s=0.05,
               what=lambda got: f"{tier} queue has {got}, expected {n}")


class Hog:
    """A long streamed request holding the worker's only slot until ``release()`` closes it."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http
        self._started = asyncio.Event()
        self._release = asyncio.Event()
        self._task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        async with self._http.stream("POST", "/v1/chat/completions", json=body(3500, stream=True),
                                     headers={"X-Switchyard-Tier": "enterprise"}) as resp:
            assert resp.status_code == 200
            self._started.set()
            await self._release.wait()  # leaving the block disconnects: the worker cancels the hog

    async def started(self) -> None:
        await asyncio.wait_for(self._started.wait(), 30)

    async def release(self) -> None:
        self._release.set()
        await self._task


async def chat(http: httpx.AsyncClient, tier: str, max_tokens: int = 4) -> tuple[httpx.Response, float]:
    t0 = time.monotonic()
    r = await http.post("/v1/chat/completions", json=body(max_tokens), headers={"X-Switchyard-Tier": tier})
    return r, time.monotonic() - t0


async def test_full_queue_is_429_and_limits_change_live(tiers_model):
    base_url, auth = tiers_model
    async with httpx.AsyncClient(base_url=base_url, timeout=60, headers=auth) as http:
        await set_tier(http, "free", max_queued=2, max_wait_s=60)
        hog = Hog(http)
        await hog.started()
        first = [asyncio.create_task(chat(http, "free")) for _ in range(2)]
        await wait_queued(http, "free", 2)

        r, _ = await chat(http, "free")
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) > 0
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["code"] == "queue_full" and "free" in err["message"]

        await set_tier(http, "free", max_queued=3)  # raised live: the next one is accepted
        third = asyncio.create_task(chat(http, "free"))
        await wait_queued(http, "free", 3)

        await set_tier(http, "free", max_queued=1)  # lowered: new ones shed, queued ones kept
        r, _ = await chat(http, "free")
        assert r.status_code == 429
        assert await queued(http, "free") == 3

        await hog.release()
        for r, _ in await asyncio.gather(*first, third):
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4


async def test_queue_timeout_answers_503_with_retry_after(tiers_model):
    base_url, auth = tiers_model
    async with httpx.AsyncClient(base_url=base_url, timeout=60, headers=auth) as http:
        await set_tier(http, "free", max_queued=10, max_wait_s=1)
        hog = Hog(http)
        await hog.started()
        r, waited = await chat(http, "free")
        await hog.release()
        await wait_queued(http, "free", 0)  # the worker answers the expired request (to no one) and drops it
        assert r.status_code == 503
        assert r.json()["error"]["code"] == "queue_timeout"
        assert int(r.headers["retry-after"]) > 0
        assert waited < 10
        await set_tier(http, "free", max_wait_s=60)


async def test_pro_gets_through_a_free_flood_and_nothing_is_lost(tiers_model):
    base_url, auth = tiers_model
    async with httpx.AsyncClient(base_url=base_url, timeout=120, headers=auth) as http:
        await set_tier(http, "free", max_queued=8, max_wait_s=60)
        await set_tier(http, "pro", max_queued=8, max_wait_s=60)
        hog = Hog(http)
        await hog.started()
        flood = [asyncio.create_task(chat(http, "free", max_tokens=40)) for _ in range(30)]
        await wait_queued(http, "free", 8)
        pro = [asyncio.create_task(chat(http, "pro", max_tokens=40)) for _ in range(3)]
        await wait_queued(http, "pro", 3)
        await hog.release()
        free_results = await asyncio.gather(*flood)
        pro_results = await asyncio.gather(*pro)

    outcomes = {"completed": 0, "queue_full": 0, "queue_timeout": 0}
    for r, _ in free_results + pro_results:
        if r.status_code == 200:
            assert r.json()["usage"]["completion_tokens"] == 40
            outcomes["completed"] += 1
        else:
            code = r.json()["error"]["code"]
            assert (r.status_code, code) in {(429, "queue_full"), (503, "queue_timeout")}, r.text
            outcomes[code] += 1
    assert sum(outcomes.values()) == 33  # sent = completed + rejected with a reason: nothing lost
    assert outcomes["completed"] >= 11, outcomes  # everything queued ran (8 free + 3 pro)
    assert all(r.status_code == 200 for r, _ in pro_results)
    completed_free = sorted(t for r, t in free_results if r.status_code == 200)
    # Pro requests arrived after 8 free ones were queued, yet finished before the median of those free ones.
    assert max(t for _, t in pro_results) < completed_free[len(completed_free) // 2], json.dumps(
        {"pro": [t for _, t in pro_results], "free": completed_free})


async def test_admin_api_needs_the_admin_key(tiers_model):
    base_url, _ = tiers_model
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        r = await http.get("/admin/tiers", headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = await http.put("/admin/tiers/gold", headers=ADMIN, json={"weight": 2})
        assert r.status_code == 400


async def test_the_pausing_quantum_is_set_live_and_bad_values_are_refused(tiers_model):
    base_url, _ = tiers_model
    async with httpx.AsyncClient(base_url=base_url, timeout=10) as http:
        try:
            r = await http.put("/admin/tiers/free", headers=ADMIN, json={"pause_after_tokens": 64})
            assert r.status_code == 200 and r.json()["new"]["pause_after_tokens"] == 64, r.text
            rows = (await http.get("/admin/tiers", headers=ADMIN)).json()["data"]
            assert next(r["pause_after_tokens"] for r in rows if r["model"] == MODEL and r["tier"] == "free") \
                == "after 64 tokens"
            for tier, value, code in (("free", -1, "invalid_request"), ("free", "soon", "invalid_request"),
                                      ("batch", 64, "invalid_value")):
                r = await http.put(f"/admin/tiers/{tier}", headers=ADMIN, json={"pause_after_tokens": value})
                assert r.status_code == 400 and r.json()["error"]["code"] == code, r.text
                assert "pause_after_tokens" in r.json()["error"]["message"] or tier == "batch", r.text
        finally:
            await http.put("/admin/tiers/free", headers=ADMIN, json={"pause_after_tokens": 256})
