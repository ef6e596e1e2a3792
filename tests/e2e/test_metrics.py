"""Prometheus metrics through the real system: the gateway's ``/metrics`` and the worker's (found through the worker
registry) count what was sent, and the queue and KV gauges follow a flood up and back down."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys

import httpx
import nats
from prometheus_client.parser import text_string_to_metric_families

from switchyard.shared.jetstream import live_workers
from tests.e2e.conftest import TINY
from tests.support.system import poll

MAX_TOKENS = 8


async def scrape(http: httpx.AsyncClient, url: str, headers: dict | None = None) -> dict[tuple[str, frozenset], float]:
    """Every sample at ``url``: (name, labels) -> value."""
    response = await http.get(url, headers=headers)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("text/plain")
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(response.text) for s in family.samples}


def value(samples: dict, metric: str, **labels) -> float:
    """The sum of ``metric``'s samples whose labels include ``labels`` (0 when none)."""
    want = set(labels.items())
    return sum(v for (name, got), v in samples.items() if name == metric and want <= got)


async def worker_metrics_url(nats_url: str) -> str:
    nc = await nats.connect(nats_url)
    try:
        workers = [w for w in await live_workers(nc.jetstream()) if w.model == TINY]
    finally:
        await nc.close()
    assert len(workers) == 1 and workers[0].metrics_url.startswith("http://"), workers
    return workers[0].metrics_url


async def top_row(e2e, model: str, tier: str) -> dict[str, str]:
    """``switchyard top --once`` against the e2e system: the row of ``model`` and ``tier``."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "switchyard.cli.main", "top", "--once", "--interval", "1",
        "--nats-url", e2e.config.nats_url, "--database-url", e2e.config.database_url, "--gateway", e2e.base_url,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    lines = out.decode().splitlines()
    header = next(line.split() for line in lines if line.split()[:2] == ["model", "tier"])
    rows = [dict(zip(header, line.split())) for line in lines if line.split()[:2] == [model, tier]]
    assert len(rows) == 1, out.decode()
    return rows[0]


async def test_metrics_count_requests_and_follow_a_flood(e2e, nats_url, new_key):
    _, key = await new_key("pro", rpm_limit=10_000)
    worker_url = await worker_metrics_url(nats_url)
    gateway_url = f"{e2e.base_url}/metrics"
    headers = {"Authorization": f"Bearer {key}", "X-Switchyard-Tier": "enterprise"}
    async with httpx.AsyncClient(base_url=e2e.base_url, timeout=60, headers=headers) as http:
        gw0, wk0 = await scrape(http, gateway_url), await scrape(http, worker_url)

        # Five requests, three streamed: every one counted once, every histogram holding it.
        async def one(stream: bool) -> dict:
            body = {"model": TINY, "messages": [{"role": "user", "content": "count"}], "max_tokens": MAX_TOKENS,
                    "temperature": 0, "ignore_eos": True, "stream": stream,
                    **({"stream_options": {"include_usage": True}} if stream else {})}
            if not stream:
                r = await http.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["usage"]
            usage = None
            async with http.stream("POST", "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        usage = json.loads(line[6:])["usage"]
            return usage

        usages = await asyncio.gather(*(one(stream=i < 3) for i in range(5)))
        assert all(u["completion_tokens"] == MAX_TOKENS for u in usages)
        # A request to an unknown tier: a 400 counted by reason, not by the name the client made up.
        bad = await http.post("/v1/chat/completions", json={"model": "no-such-model",
                                                            "messages": [{"role": "user", "content": "hi"}]},
                              headers={"X-Switchyard-Tier": "platinum"})
        assert bad.status_code == 400

        # The worker's counters move when it publishes a step's outcome, before the gateway answers; the gateway's
        # histograms before the response ends. Nothing to wait for but a scrape.
        gw1, wk1 = await scrape(http, gateway_url), await scrape(http, worker_url)

        def grew(after, before, metric, **labels):
            return value(after, metric, **labels) - value(before, metric, **labels)

        tiny = {"model": TINY, "tier": "enterprise"}
        assert grew(wk1, wk0, "switchyard:request_success_total", finished_reason="length", **tiny) == 5
        assert grew(wk1, wk0, "switchyard:generation_tokens_total", **tiny) == 5 * MAX_TOKENS
        assert grew(wk1, wk0, "switchyard:prompt_tokens_total", **tiny) == sum(u["prompt_tokens"] for u in usages)
        assert grew(wk1, wk0, "switchyard:request_queue_time_seconds_count", **tiny) == 5
        assert grew(wk1, wk0, "switchyard:engine_step_seconds_count", model=TINY) >= MAX_TOKENS
        assert grew(wk1, wk0, "switchyard:prefix_cache_queries_total", model=TINY) > 0
        assert grew(gw1, gw0, "switchyard:time_to_first_token_seconds_count", **tiny) == 5
        assert grew(gw1, gw0, "switchyard:e2e_request_latency_seconds_count", **tiny) == 5
        # One interval per token after the first, also where one delta brought two (a held-back character).
        assert grew(gw1, gw0, "switchyard:inter_token_latency_seconds_count", **tiny) == 5 * (MAX_TOKENS - 1)
        assert grew(gw1, gw0, "switchyard:time_to_first_token_seconds_bucket", le="+Inf", **tiny) == 5
        assert grew(gw1, gw0, "switchyard:admission_seconds_count", tier="enterprise", outcome="admitted") == 5
        assert grew(gw1, gw0, "switchyard:request_errors_total", status="400", reason="invalid_tier") == 1
        assert not any(name == "switchyard:request_errors_total" and ("model", "no-such-model") in labels
                       for name, labels in gw1)

        # A flood on the free tier: 16 long streams for a worker of 4 seats. The queue gauge (read from JetStream
        # every few seconds) rises, and the worker's KV cache fills.
        free = {**headers, "X-Switchyard-Tier": "free"}
        flood_body = {"model": TINY, "messages": [{"role": "user", "content": "flood"}], "max_tokens": 3000,
                      "temperature": 0, "ignore_eos": True, "stream": True}

        async def flood_stream() -> None:
            async with http.stream("POST", "/v1/chat/completions", json=flood_body, headers=free) as r:
                async for _ in r.aiter_lines():
                    pass

        flood = [asyncio.create_task(flood_stream()) for _ in range(16)]
        try:
            gauges = await poll(lambda: scrape(http, gateway_url),
                                lambda s: value(s, "switchyard:queue_depth", model=TINY, tier="free") >= 4,
                                timeout_s=30, what="the free queue's depth gauge rising under the flood")
            assert value(gauges, "switchyard:queue_oldest_age_seconds", model=TINY, tier="free") > 0
            assert value(gauges, "switchyard:queue_backlog_tokens", model=TINY, tier="free") >= 4 * 3000
            await poll(lambda: scrape(http, worker_url),
                       lambda s: value(s, "switchyard:kv_cache_usage_perc", model=TINY) > 0
                       and value(s, "switchyard:num_requests_running", model=TINY, tier="free") == 4,
                       timeout_s=30, what="the worker's KV usage and running gauge under the flood")
            # `switchyard top` sees the same: the free queue, its four running, tokens flowing.
            row = await top_row(e2e, TINY, "free")
            assert int(row["queued"]) >= 4 and row["oldest_wait"] != "-", row
            assert int(row["running"]) == 4 and float(row["tokens_per_s"]) > 0, row
        finally:
            for task in flood:  # the clients go away: their requests are cancelled, queued ones never run
                task.cancel()
            for task in flood:
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await task
        await poll(lambda: scrape(http, gateway_url),
                   lambda s: value(s, "switchyard:queue_depth", model=TINY, tier="free") == 0,
                   timeout_s=60, what="the free queue's depth gauge back at 0")
        await poll(lambda: scrape(http, worker_url),
                   lambda s: value(s, "switchyard:kv_cache_usage_perc", model=TINY) == 0
                   and value(s, "switchyard:num_requests_running", model=TINY) == 0,
                   timeout_s=60, what="the worker's KV usage back at 0")
