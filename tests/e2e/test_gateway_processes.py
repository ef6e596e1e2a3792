"""Several gateway processes on one port (``switchyard up --gateways N``): the kernel spreads connections over them
(SO_REUSEPORT), each response names the process that answered (``x-switchyard-gateway``), and a tenant's limits
hold across them, since every limit lives in NATS and Postgres."""

from __future__ import annotations

import asyncio
import socket

import httpx

from switchyard.deploy.services import wait_until_ready
from tests.e2e.conftest import TINY
from tests.support.system import free_port


async def test_two_processes_share_the_port_and_a_key_s_request_limit(e2e, new_key):
    port = free_port()
    first = e2e.start_gateway("gateway-pair", port=port, processes=2)
    pair = [s for s in e2e.services if s.name.startswith("gateway-pair")]
    try:
        assert len(pair) == 2 and first in pair
        base = e2e.url(port)
        wait_until_ready(base, TINY, timeout_s=60, watch=pair)
        processes = set()
        for _ in range(40):  # a new connection each time: the kernel picks a process per connection
            async with httpx.AsyncClient(timeout=10) as http:
                r = await http.get(f"{base}/healthz")
                processes.add(r.json()["process"])
                # Every response names the process that answered it, as <host>:<pid>.
                assert r.headers["x-switchyard-gateway"] == f"{socket.gethostname()}:{r.json()['process']}"
        assert processes == {s.pid for s in pair}
        async with httpx.AsyncClient(timeout=10) as http:  # an error answered before any route, too
            refused = await http.post(f"{base}/v1/completions", json={"model": TINY, "prompt": "hi"})
        assert refused.status_code == 401
        assert int(refused.headers["x-switchyard-gateway"].rsplit(":", 1)[1]) in processes

        _, secret = await new_key(rpm_limit=4)

        async def one() -> int:
            async with httpx.AsyncClient(timeout=60) as http:  # each on its own connection
                r = await http.post(f"{base}/v1/completions", headers={"Authorization": f"Bearer {secret}"},
                                    json={"model": TINY, "prompt": "hi", "max_tokens": 1})
                return r.status_code

        codes = await asyncio.gather(*(one() for _ in range(10)))
        assert sorted(codes) == [200] * 4 + [429] * 6  # one limit, whichever process answered
    finally:
        for service in pair:
            service.stop()
