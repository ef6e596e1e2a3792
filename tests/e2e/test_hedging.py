"""Hedged requests on real processes (gateway/hedging.py): an enterprise request whose worker stalls (SIGSTOP) before
its first token is served by a second worker, whole and billed once, and the stalled one bills nothing; a hedge
whose second worker dies leaves the request to the first; both dying, it goes on on a third, as a failover does."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid

import httpx
import nats
import pytest

from switchyard.deploy.services import wait_until_ready
from switchyard.shared import subjects
from switchyard.shared.jetstream import live_workers
from switchyard.shared.messages import TokenDelta, decode, decode_routed
from tests.e2e.conftest import ADMIN_KEY
from tests.support.system import free_port, make_key, poll, usage_rows

PROMPT = "once upon a time there was a hedge"  # 9 prompt tokens to the simulated engine
PREFILL_US_PER_TOKEN = 150_000  # a first token 1.35 s after a worker takes it: time to stall it before
MAX_TOKENS = 100  # a second's stream: a loser resumed at its first token cannot finish before it hears it lost


class Fleet:
    """Simulated workers of one model, their pids and metrics by worker id, and the first worker to take each new
    request (from the deltas sent to the gateways)."""

    def __init__(self, e2e, system: str, nats_url: str, name: str, size: int) -> None:
        self.e2e, self.system, self.nats_url, self.name = e2e, system, nats_url, name
        self.processes = [e2e.start_worker(name, max_num_seqs=4, engine="simulated", simulated_tokens_per_s=100,
                                           simulated_prefill_us_per_token=PREFILL_US_PER_TOKEN,
                                           metrics_port=free_port()) for _ in range(size)]
        self.pids: dict[str, int] = {}
        self.metrics_urls: dict[str, str] = {}
        self.taken: asyncio.Queue[str] = asyncio.Queue()  # worker ids, in the order they took our request

    async def __aenter__(self) -> Fleet:
        wait_until_ready(self.system, self.name, timeout_s=60, watch=self.processes)
        self.nc = await nats.connect(self.nats_url)
        workers = await poll(lambda: live_workers(self.nc.jetstream()),
                             until=lambda ws: sum(w.model == self.name for w in ws) == len(self.processes),
                             timeout_s=30, what="every worker registered")
        for w in workers:
            if w.model == self.name:
                self.pids[w.worker_id], self.metrics_urls[w.worker_id] = w.pid, w.metrics_url
        seen: set[tuple[str, str]] = set()

        async def on_deltas(msg) -> None:
            for routed in decode_routed(msg.data):
                worker = decode(routed.delta, TokenDelta).worker_id
                if worker in self.pids and (routed.request_id, worker) not in seen:
                    seen.add((routed.request_id, worker))
                    self.taken.put_nowait(worker)

        self._sub = await self.nc.subscribe(subjects.gateway_token_subject("*"), cb=on_deltas)
        return self

    async def __aexit__(self, *exc) -> None:
        for pid in self.pids.values():
            try:
                os.kill(pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        await self.nc.close()
        for process in self.processes:
            process.stop()

    async def next_taker(self) -> str:
        return await asyncio.wait_for(self.taken.get(), 15)

    def signal(self, worker_id: str, sig: int) -> None:
        os.kill(self.pids[worker_id], sig)

    async def dismissed_tokens(self, worker_id: str) -> float:
        async with httpx.AsyncClient(timeout=10) as http:
            text = (await http.get(f"{self.metrics_urls[worker_id]}")).text
        return _sample(text, "switchyard:worker_dismissed_tokens_total", self.name)


def _sample(text: str, metric: str, model: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(metric + "{") and f'model="{model}"' in line)


@pytest.fixture
async def hedged_enterprise(system):
    """The enterprise tier hedged after 300 ms with every request in its budget, for this test only."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    async with httpx.AsyncClient(timeout=30) as http:
        r = await http.put(f"{system}/admin/tiers/enterprise", headers=admin,
                           json={"hedge_after_ms": 300, "hedge_budget": 1.0})
        assert r.status_code == 200, r.text
        assert r.json()["new"]["hedge_after_ms"] == 300
        try:
            yield
        finally:
            await http.put(f"{system}/admin/tiers/enterprise", headers=admin,
                           json={"hedge_after_ms": "off", "hedge_budget": 0.05})


async def _stream(system: str, key: str, body: dict, while_streaming,
                  got_text: asyncio.Event | None = None) -> tuple[str, dict, str]:
    """A streamed completion, with ``while_streaming`` running beside it (``got_text`` set at the first text):
    (text, usage, request id)."""
    text, usage = "", None
    async with httpx.AsyncClient(timeout=60) as http:
        work = asyncio.create_task(while_streaming())
        try:
            async with http.stream("POST", f"{system}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                                   json=body) as r:
                assert r.status_code == 200
                request_id = r.headers["X-Request-Id"]
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        event = json.loads(line[6:])
                        assert "error" not in event, event
                        usage = event.get("usage") or usage
                        if event["choices"]:
                            text += event["choices"][0]["text"]
                        if text and got_text is not None:
                            got_text.set()
            await work
        finally:
            work.cancel()
    assert usage is not None
    return text, usage, request_id


async def _reference_text(system: str, key: str, body: dict) -> str:
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(f"{system}/v1/completions", headers={"Authorization": f"Bearer {key}"},
                            json={**body, "stream": False, "stream_options": None})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]


def _body(name: str) -> dict:
    return {"model": name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


async def _hedges(system: str) -> tuple[float, float]:
    """The gateway's enterprise hedges started and won, every model's (a model new to it may be labelled "")."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{system}/metrics")).text
    return tuple(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()  # type: ignore[return-value]
                     if line.startswith(metric + "{") and 'tier="enterprise"' in line)
                 for metric in ("switchyard:hedges_started_total", "switchyard:hedges_won_total"))


async def _skipped(system: str) -> list[str]:
    """The gateway's hedges_skipped samples: why a hedge due was not started."""
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"{system}/metrics")).text
    return [line for line in text.splitlines() if line.startswith("switchyard:hedges_skipped_total{")]


async def _served_whole_and_billed_once_by(worker: str, streamed: tuple[str, dict, str], system: str, key: str,
                                           name: str, database_url: str, nats_url: str) -> None:
    text, usage, request_id = streamed
    assert usage["completion_tokens"] == MAX_TOKENS
    assert text == await _reference_text(system, key, _body(name))  # nothing missing or doubled
    (row,) = await usage_rows(database_url, nats_url, request_id, "completion_tokens, worker_id")
    assert row["worker_id"] == worker and row["completion_tokens"] == MAX_TOKENS


async def test_a_request_on_a_stalled_worker_is_served_by_its_hedge_whole_and_billed_once(
        e2e, system, nats_url, database_url, hedged_enterprise):
    name = f"sim-hedge-{uuid.uuid4().hex[:6]}"
    key = await make_key(database_url, f"hedge-{uuid.uuid4().hex[:8]}", tier="enterprise")
    async with Fleet(e2e, system, nats_url, name, 2) as fleet:
        stalled: list[str] = []
        hedges_before = await _hedges(system)

        got_text = asyncio.Event()

        async def stall_the_first_then_see_the_hedge() -> None:
            first = await fleet.next_taker()
            fleet.signal(first, signal.SIGSTOP)  # alive, but stuck before its first token
            stalled.append(first)
            stalled.append(await fleet.next_taker())  # the second worker took the hedge
            await got_text.wait()
            fleet.signal(first, signal.SIGCONT)  # it goes on, its tokens due: none may reach the client

        text, usage, request_id = await _stream(system, key, _body(name), stall_the_first_then_see_the_hedge,
                                                got_text)
        first, second = stalled
        started, won = await _hedges(system)
        assert first != second and (started - hedges_before[0], won - hedges_before[1]) == (1, 1), \
            await _skipped(system)
        await _served_whole_and_billed_once_by(second, (text, usage, request_id), system, key, name, database_url,
                                               nats_url)
        # The stalled worker, resumed, was told it lost: it stops, bills nothing, and counts what it computed.
        assert await poll(lambda: fleet.dismissed_tokens(first), until=lambda n: n > 0, timeout_s=20,
                          what="the loser's dismissed tokens")


async def test_a_hedge_whose_worker_dies_leaves_the_request_to_the_first(
        e2e, system, nats_url, database_url, hedged_enterprise):
    name = f"sim-hedge-dies-{uuid.uuid4().hex[:6]}"
    key = await make_key(database_url, f"hedge-{uuid.uuid4().hex[:8]}", tier="enterprise")
    async with Fleet(e2e, system, nats_url, name, 2) as fleet:
        order: list[str] = []

        async def stall_the_first_and_kill_the_hedge() -> None:
            first = await fleet.next_taker()
            fleet.signal(first, signal.SIGSTOP)
            second = await fleet.next_taker()
            fleet.signal(second, signal.SIGKILL)
            fleet.signal(first, signal.SIGCONT)
            order.extend([first, second])

        streamed = await _stream(system, key, _body(name), stall_the_first_and_kill_the_hedge)
        await _served_whole_and_billed_once_by(order[0], streamed, system, key, name, database_url, nats_url)


async def test_a_hedged_request_whose_two_workers_die_goes_on_on_a_third(
        e2e, system, nats_url, database_url, hedged_enterprise):
    name = f"sim-hedge-both-{uuid.uuid4().hex[:6]}"
    key = await make_key(database_url, f"hedge-{uuid.uuid4().hex[:8]}", tier="enterprise")
    async with Fleet(e2e, system, nats_url, name, 3) as fleet:
        order: list[str] = []

        async def stall_the_first_then_kill_both() -> None:
            first = await fleet.next_taker()
            fleet.signal(first, signal.SIGSTOP)
            second = await fleet.next_taker()
            fleet.signal(second, signal.SIGKILL)
            fleet.signal(first, signal.SIGKILL)
            order.extend([first, second, await fleet.next_taker()])  # the continuation's worker

        streamed = await _stream(system, key, _body(name), stall_the_first_then_kill_both)
        first, second, third = order
        assert third not in (first, second)
        await _served_whole_and_billed_once_by(third, streamed, system, key, name, database_url, nats_url)
