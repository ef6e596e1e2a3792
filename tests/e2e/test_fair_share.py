"""Fair share between the tenants of a tier, on real servers: one tenant's flood fills its own queue (429 beyond
its cap) while another tenant of the same tier is still let in, and the worker serves the less-served tenant
first instead of first-in-first-out, so the light tenant does not wait behind the flood."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import openai
import pytest
from openai import AsyncOpenAI

from switchyard.deploy.services import wait_until_ready
from tests.e2e.conftest import ADMIN_KEY
from tests.support.system import poll

MODEL = "tiny-fair"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}


@pytest.fixture(scope="module")
def one_seat(e2e):
    """A worker of its own with a single seat, so requests run one after another in the order it picks."""
    worker = e2e.start_worker(MODEL, max_num_seqs=1)
    wait_until_ready(e2e.base_url, MODEL, timeout_s=120, watch=[worker])
    original = {r["tier"]: r for r in httpx.get(f"{e2e.base_url}/admin/tiers", headers=ADMIN).json()["data"]
                if r["model"] == MODEL}
    yield e2e.base_url
    row = original["free"]
    httpx.put(f"{e2e.base_url}/admin/tiers/free", headers=ADMIN, json={
        "max_queued": row["max_queued"], "max_wait_s": row["max_wait_s"], "max_queued_per_tenant": 0})
    worker.stop()


def body(max_tokens: int, stream: bool = False) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": max_tokens,
            "ignore_eos": True, "temperature": 0, "stream": stream}


async def test_a_flood_fills_its_own_queue_and_the_light_tenant_is_served_next(one_seat, new_key, database_url):
    base_url = one_seat
    made = [await new_key("free", rpm_limit=10_000, tpm_limit=10_000_000) for _ in range(2)]
    conn = await asyncpg.connect(database_url)
    try:
        ids = {name: await conn.fetchval("SELECT id FROM tenants WHERE name = $1", name) for name, _ in made}
    finally:
        await conn.close()
    # Two tenants new to the worker start level, and a tie goes to the smaller id: the heavy tenant is the one with
    # the larger, so only serving the less-served tenant first (not arrival order, not a tie) puts light first.
    (_, light_key), (_, heavy_key) = sorted(made, key=lambda m: ids[m[0]])
    keys = {"heavy": heavy_key, "light": light_key}
    _, hog_key = await new_key("enterprise", rpm_limit=10_000, tpm_limit=10_000_000)
    async with httpx.AsyncClient(base_url=base_url, timeout=120) as http:
        r = await http.put("/admin/tiers/free", headers=ADMIN,
                           json={"max_queued": 20, "max_queued_per_tenant": 5, "max_wait_s": 120})
        assert r.status_code == 200, r.text

        clients = {name: AsyncOpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)
                   for name, key in keys.items()}

        def post(name: str):
            return clients[name].chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                                         max_tokens=4, temperature=0, extra_body={"ignore_eos": True})

        async def queued() -> int:
            rows = (await http.get("/admin/tiers", headers=ADMIN)).json()["data"]
            return next(r["queued"] for r in rows if r["model"] == MODEL and r["tier"] == "free")

        # A long request of another tenant holds the only seat while the queue fills.
        started, release = asyncio.Event(), asyncio.Event()

        async def hog() -> None:
            async with http.stream("POST", "/v1/chat/completions", json=body(3500, stream=True),
                                   headers={"Authorization": f"Bearer {hog_key}"}) as resp:
                assert resp.status_code == 200
                started.set()
                await release.wait()

        hogging = asyncio.create_task(hog())
        await asyncio.wait_for(started.wait(), 30)
        finished: list[str] = []

        async def request(name: str):
            completion = await post(name)
            finished.append(name)
            return completion

        heavy = [asyncio.create_task(request("heavy")) for _ in range(5)]
        await poll(queued, lambda n: n == 5, timeout_s=20, what="the heavy tenant's 5 queued")
        with pytest.raises(openai.RateLimitError) as over:  # its own queue is full: refused, the tier has room
            await post("heavy")
        assert over.value.body["code"] == "queue_full"
        assert over.value.body["message"].startswith("Your free tier queue")
        light = [asyncio.create_task(request("light")) for _ in range(2)]
        await poll(queued, lambda n: n == 7, timeout_s=20, what="the light tenant's 2 queued too")
        release.set()
        await hogging
        responses = await asyncio.gather(*heavy, *light)
        for client in clients.values():
            await client.close()

    assert all(r.usage.completion_tokens == 4 for r in responses)
    # Served one at a time, least-served tenant first: the light tenant's two within the first four, not after the
    # heavy tenant's five as first-in-first-out would have it.
    assert sorted(i for i, name in enumerate(finished) if name == "light")[-1] < 4, finished
