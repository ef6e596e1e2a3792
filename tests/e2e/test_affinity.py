"""Cache-aware placement on real servers, two workers of one model: each follow-up turn of a conversation is
served by the worker that served its previous turn (its history found in that worker's prefix cache), and when
that worker is busy the turn goes to the other after the short offer, never waiting for it; nothing runs twice."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import pytest

from switchyard.deploy.services import wait_until_ready
from switchyard.deploy.system import LocalSystem
from tests.support.system import free_port, poll

SYSTEM = "You are a careful assistant. " * 40  # long enough to fill several KV blocks


def start_two(e2e, model: str, seats: int) -> list:
    started = [LocalSystem.start_worker(e2e, f"worker-{model}-{i}", served_model_name=model, max_num_seqs=seats)
               for i in range(2)]
    wait_until_ready(e2e.base_url, model, timeout_s=120, watch=started)
    return started


async def usage_rows(database_url: str, request_ids: list[str]) -> dict[str, asyncpg.Record]:
    conn = await asyncpg.connect(database_url)
    try:
        async def fetch():
            return {r["request_id"]: r for r in await conn.fetch(
                "SELECT request_id, worker_id, cached_tokens, prompt_tokens FROM requests "
                "WHERE request_id = any($1::text[])", request_ids)}
        return await poll(fetch, lambda rows: len(rows) == len(request_ids), timeout_s=30, what="the usage rows")
    finally:
        await conn.close()


@pytest.fixture
async def key(new_key) -> dict[str, str]:
    _, secret = await new_key("pro", rpm_limit=10_000, tpm_limit=10_000_000)
    return {"Authorization": f"Bearer {secret}"}


async def test_follow_up_turns_go_to_the_worker_holding_the_conversation(e2e, key, database_url):
    model = "tiny-affinity"
    workers = start_two(e2e, model, seats=8)  # a free seat for every conversation on either worker
    # A gateway of its own whose offers outlast a loaded machine's slowest pull: this test is about placement,
    # not the fallback (the next test).
    port = free_port()
    gateway = e2e.start_gateway("gateway-affinity", port=port, affinity_wait_s=10.0)
    ids: list[list[str]] = []
    try:
        wait_until_ready(e2e.url(port), model, timeout_s=60, watch=[gateway])
        async with httpx.AsyncClient(base_url=e2e.url(port), timeout=60, headers=key) as http:
            async def conversation(n: int) -> None:
                messages = [{"role": "system", "content": SYSTEM + f" Conversation {n}."}]
                mine = []
                for turn in range(3):
                    messages.append({"role": "user", "content": f"Turn {turn} of conversation {n}: go on."})
                    r = await http.post("/v1/chat/completions", json={"model": model, "messages": messages,
                                                                       "max_tokens": 8, "temperature": 0})
                    assert r.status_code == 200, r.text
                    messages.append(r.json()["choices"][0]["message"])
                    mine.append(r.headers["X-Request-Id"])
                ids.append(mine)

            await asyncio.gather(*(conversation(n) for n in range(6)))
        rows = await usage_rows(database_url, [i for conv in ids for i in conv])
    finally:
        gateway.stop()
        for w in workers:
            w.stop()
    for conv in ids:
        served_by = [rows[i]["worker_id"] for i in conv]
        assert len(set(served_by)) == 1, served_by  # every turn on the worker of the first
        for turn in conv[1:]:  # the history (the long system prompt, earlier turns) came from the prefix cache
            assert rows[turn]["cached_tokens"] >= rows[conv[0]]["prompt_tokens"] - 16, dict(rows[turn])


async def test_a_busy_holder_does_not_hold_the_turn_up(e2e, system, key, database_url):
    model = "tiny-affinity-busy"
    workers = start_two(e2e, model, seats=1)
    try:
        async with httpx.AsyncClient(base_url=system, timeout=120, headers=key) as http:
            history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
            first = await http.post("/v1/chat/completions", json={"model": model, "messages": history,
                                                                   "max_tokens": 4})
            assert first.status_code == 200
            history.append(first.json()["choices"][0]["message"])
            # A long follow-up goes to the holder (its prefix is there) and takes its only seat...
            busy, release = asyncio.Event(), asyncio.Event()

            async def long_turn() -> str:
                body = {"model": model, "messages": [*history, {"role": "user", "content": "long"}],
                        "max_tokens": 3000, "ignore_eos": True, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                    assert resp.status_code == 200
                    async for line in resp.aiter_lines():  # read on: a client that stops reading goes away
                        if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                            busy.set()
                        if release.is_set() or line == "data: [DONE]":
                            break
                return resp.headers["X-Request-Id"], line

            hog = asyncio.create_task(long_turn())
            await asyncio.wait_for(busy.wait(), 30)
            # ...so another follow-up of the same history, offered to the holder first, runs on the other worker
            # while the long one still runs there.
            other = await http.post("/v1/chat/completions", json={
                "model": model, "messages": [*history, {"role": "user", "content": "short"}], "max_tokens": 4})
            assert other.status_code == 200, other.text
            assert not hog.done(), "the short turn must not have waited for the long one"
            release.set()
            hog_id, last_line = await hog
            assert last_line != "data: [DONE]", "the long turn was still running when the short one ended"
        rows = await usage_rows(database_url, [first.headers["X-Request-Id"], hog_id, other.headers["X-Request-Id"]])
    finally:
        for w in workers:
            w.stop()
    holder = rows[first.headers["X-Request-Id"]]["worker_id"]
    assert rows[hog_id]["worker_id"] == holder
    assert rows[other.headers["X-Request-Id"]]["worker_id"] not in (None, holder)
