"""A worker killed mid-stream, on real processes: the client hears of it within seconds, not after the stall
timeout."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx

from switchyard.deploy.services import wait_until_ready


async def test_a_stream_whose_worker_is_killed_ends_with_an_error_within_5_s(e2e, system, auth):
    name = "tiny-doomed"
    worker = e2e.start_worker(name, max_num_seqs=2)
    try:
        wait_until_ready(system, name, timeout_s=120, watch=[worker])
        body = {"model": name, "prompt": "once upon a time", "max_tokens": 4000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        killed_at, error = None, None
        async with httpx.AsyncClient(timeout=60) as http:
            async with http.stream("POST", f"{system}/v1/completions", json=body, headers=auth) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]
                        break
                    if killed_at is None and event["choices"][0]["text"]:
                        os.kill(worker.pid, signal.SIGKILL)
                        killed_at = time.monotonic()
        assert killed_at is not None and error is not None
        assert error["code"] == "worker_lost", error
        assert time.monotonic() - killed_at < 5.0
    finally:
        worker.stop()
