"""Work nobody waits for, tried as a hostile client would: a non-streamed request whose client went away (a client
timeout) is stopped on the worker, as a stream is; a stream whose reader stops reading is ended once it falls
behind by more than its bounds, its work stopped and its seat freed. Each is billed for what ran."""

from __future__ import annotations

import json
import socket
import time

import asyncpg
import httpx
import pytest

from switchyard.deploy.services import wait_until_ready
from tests.support.system import free_port, poll

MODEL = "tiny"


def chat_body(max_tokens: int, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, **extra}


async def billed(database_url: str, tenant: str, timeout_s: float = 30) -> dict:
    """The tenant's one usage row, once written and the tenant's seat given back: what ran, and how it ended."""
    conn = await asyncpg.connect(database_url)
    try:
        async def row():
            return await conn.fetchrow(
                "SELECT r.finish_reason, r.completion_tokens, (SELECT count(*) FROM open_requests o "
                "WHERE o.tenant_id = t.id) AS open FROM requests r JOIN tenants t ON t.id = r.tenant_id "
                "WHERE t.name = $1", tenant)
        return dict(await poll(row, lambda r: r is not None and r["open"] == 0, timeout_s=timeout_s,
                               what=lambda r: f"the usage row of {tenant}, with its seat given back: {r}"))
    finally:
        await conn.close()


async def test_a_non_streamed_request_whose_client_left_is_stopped(system, new_key, database_url):
    tenant, secret = await new_key("pro")
    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=system, headers={"Authorization": f"Bearer {secret}"},
                                 timeout=httpx.Timeout(60, read=1.5)) as http:
        with pytest.raises(httpx.ReadTimeout):  # the client gives up after 1.5 s and closes its connection
            await http.post("/v1/chat/completions", json=chat_body(4000))
    row = await billed(database_url, tenant)
    # 4000 tokens would take the tiny model many seconds more: it was stopped, billed for what it generated.
    assert row["finish_reason"] == "cancelled" and 0 < row["completion_tokens"] < 4000, row
    assert time.monotonic() - t0 < 30
    assert row["open"] == 0  # its seat among the tenant's open requests was given back


@pytest.fixture(scope="module")
def strict_gateway(e2e):
    """A gateway whose streams must be read within a second, with at most 64 KiB waiting behind."""
    port = free_port()
    gateway = e2e.start_gateway("gateway-strict", port=port, run_jobs=False, stream_send_timeout_s=1.0,
                                stream_max_buffered_bytes=65_536)
    try:
        wait_until_ready(f"http://127.0.0.1:{port}", MODEL, timeout_s=60, watch=[gateway])
        yield port
    finally:
        gateway.stop()


async def test_a_stream_whose_reader_stopped_reading_is_ended_and_its_work_stopped(strict_gateway, new_key,
                                                                                 database_url):
    tenant, secret = await new_key("pro")
    # Four choices with twenty alternatives a token: kilobytes a step, so the connection's buffers fill in seconds.
    body = json.dumps(chat_body(3000, n=4, stream=True, logprobs=True, top_logprobs=20)).encode()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window, and nothing read from it
    try:
        sock.connect(("127.0.0.1", strict_gateway))
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"Authorization: Bearer {secret}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        row = await billed(database_url, tenant, timeout_s=60)
    finally:
        sock.close()
    assert row["finish_reason"] == "cancelled" and row["completion_tokens"] < 4 * 3000, row
    assert row["open"] == 0
