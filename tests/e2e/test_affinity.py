"""Cache-aware placement on real servers, two workers of one model: each follow-up turn of a conversation is
served by the worker that served its previous turn (its history found in that worker's prefix cache), and when
that worker is busy the turn goes to the other after the short offer, never waiting for it; nothing runs twice."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest
from openai import AsyncOpenAI

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
async def key(new_key) -> str:
    _, secret = await new_key("pro", rpm_limit=10_000, tpm_limit=10_000_000)
    return secret


def request_id(completion) -> str:
    return completion.id.removeprefix("chatcmpl-")


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
        async with AsyncOpenAI(base_url=f"{e2e.url(port)}/v1", api_key=key, max_retries=0, timeout=60) as client:
            async def conversation(n: int) -> None:
                # Its own from the first token: what placement weighs is the whole history against the load of
                # the moment, and a history shared by every conversation but its last words would weigh little.
                messages = [{"role": "system", "content": f"Conversation {n}. " + SYSTEM}]
                mine = []
                for turn in range(3):  # the whole history each turn, as chat clients send it
                    messages.append({"role": "user", "content": f"Turn {turn} of conversation {n}: go on."})
                    completion = await client.chat.completions.create(model=model, messages=messages, max_tokens=8,
                                                                      temperature=0)
                    messages.append(completion.choices[0].message.model_dump(exclude_none=True))
                    mine.append(request_id(completion))
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
        async with AsyncOpenAI(base_url=f"{system}/v1", api_key=key, max_retries=0, timeout=120) as client:
            history = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "first"}]
            first = await client.chat.completions.create(model=model, messages=history, max_tokens=4)
            history.append(first.choices[0].message.model_dump(exclude_none=True))
            # A long follow-up goes to the holder (its prefix is there) and takes its only seat...
            busy, release = asyncio.Event(), asyncio.Event()

            async def long_turn() -> tuple[str, bool]:
                stream = await client.chat.completions.create(
                    model=model, messages=[*history, {"role": "user", "content": "long"}], max_tokens=3000,
                    stream=True, extra_body={"ignore_eos": True})
                finished = False
                async for chunk in stream:  # read on: a client that stops reading goes away
                    if chunk.choices and chunk.choices[0].delta.content:
                        busy.set()
                    finished = finished or bool(chunk.choices and chunk.choices[0].finish_reason)
                    if release.is_set():
                        break
                await stream.close()
                return chunk.id.removeprefix("chatcmpl-"), finished

            hog = asyncio.create_task(long_turn())
            await asyncio.wait_for(busy.wait(), 30)
            # ...so another follow-up of the same history, offered to the holder first, runs on the other worker
            # while the long one still runs there.
            other = await client.chat.completions.create(
                model=model, messages=[*history, {"role": "user", "content": "short"}], max_tokens=4)
            assert not hog.done(), "the short turn must not have waited for the long one"
            release.set()
            hog_id, hog_finished = await hog
            assert not hog_finished, "the long turn was still running when the short one ended"
        rows = await usage_rows(database_url, [request_id(first), hog_id, request_id(other)])
    finally:
        for w in workers:
            w.stop()
    # The long turn ran on the holder (or, on a machine too loaded to take the offer in time, on the other): the
    # short one ran on the worker that was free, whichever the offer went to first.
    busy_worker = rows[hog_id]["worker_id"]
    assert rows[request_id(other)]["worker_id"] not in (None, busy_worker)
