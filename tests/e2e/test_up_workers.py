"""``switchyard up --workers 2``: two workers of the chat model on one machine, each its own process, both serving
its queues (the simulated engine: what is asserted is the layout, not the text); every response names the gateway
process that answered it."""

from __future__ import annotations

import socket

import httpx
import nats

from switchyard.shared.jetstream import live_workers
from tests.support.system import poll
from tests.support.up import running_up


async def test_up_runs_as_many_workers_of_the_model_as_asked():
    with running_up(["--engine", "simulated", "--workers", "2", "--no-embeddings"], ["smollm2"]) as up:
        nc = await nats.connect(up.urls["nats_url"])
        try:
            workers = await poll(lambda: live_workers(nc.jetstream()), lambda ws: len(ws) == 2, timeout_s=60,
                                 what="two workers registered")
        finally:
            await nc.close()
        assert {(w.model, w.role) for w in workers} == {("smollm2", "both")}
        assert len({w.pid for w in workers}) == 2
        async with httpx.AsyncClient(timeout=60) as http:
            r = await http.post(f"{up.base_url}/v1/completions", headers={"Authorization": f"Bearer {up.api_key}"},
                                json={"model": "smollm2", "prompt": "hi", "max_tokens": 4})
        assert r.status_code == 200, r.text
        host, pid = r.headers["x-switchyard-gateway"].rsplit(":", 1)
        assert host == socket.gethostname() and int(pid) > 0
