"""Postgres hung (every process SIGSTOPped) and down (stopped), under a running system with its own Postgres: keys
seen recently keep being served, an unknown key gets 503 with Retry-After (never a 500, never a hang), /readyz
reports the degradation, a request refused after its admission (a background response that cannot be stored)
gives its seat back, and the usage, conversation and response writes made meanwhile land exactly once when it
returns."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import asyncpg
import httpx

from switchyard.deploy.launcher import NatsServer, PostgresServer
from switchyard.deploy.system import LocalSystem
from switchyard.migrations import apply_migrations
from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
from tests.support.system import free_port, make_key, poll
from tests.support.tiny_model import save_tiny_model

MODEL = "tiny-pg-outage"
BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "ignore_eos": True}


def _process_tree(pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    return [pid] + [p for child in children for p in _process_tree(int(child))]


async def _rows(url: str, ids: list[str]) -> list:
    conn = await asyncpg.connect(url)
    try:
        return await conn.fetch("SELECT request_id FROM requests WHERE request_id = ANY($1)", ids)
    finally:
        await conn.close()


async def _served_while_away(http: httpx.AsyncClient, known: dict, unknown: dict) -> list[str]:
    """A known key is served (fast: one timeout at most, then the breaker), an unknown one refused with 503 and
    Retry-After; returns the served request ids."""
    ids = []
    for _ in range(3):
        started = time.monotonic()
        r = await http.post("/v1/chat/completions", json=BODY, headers=known)
        assert r.status_code == 200, r.text
        assert time.monotonic() - started < 8
        ids.append(r.headers["X-Request-Id"])
    started = time.monotonic()
    r = await http.post("/v1/chat/completions", json=BODY, headers=unknown)
    assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
    assert int(r.headers["Retry-After"]) > 0 and time.monotonic() - started < 5
    ready = await http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["degraded"] is True and ready.json()["checks"]["postgres"] is False
    return ids


async def test_known_keys_are_served_through_a_postgres_outage_and_its_writes_land_once(tmp_path):
    pg_dir = Path(tempfile.mkdtemp(prefix="switchyard-test-pg-outage-"))
    pg_dir.chmod(0o755)  # postgres runs as nobody under root: it must enter the directory
    pg_port = free_port()
    pg = PostgresServer(pg_dir, port=pg_port, ephemeral=True).start()
    url = pg.url
    # A NATS of its own: the session's is shared with the e2e gateway, whose billing and held-write consumers would
    # take this system's records into the session's database.
    nats_server = NatsServer(tmp_path / "nats").start()
    nats_url = nats_server.url
    try:
        await apply_migrations(url)
        known = {"Authorization": f"Bearer {await make_key(url, 'pg-known')}"}
        unknown = {"Authorization": f"Bearer {await make_key(url, 'pg-unknown')}"}
        one_seat = {"Authorization": f"Bearer {await make_key(url, 'pg-one-seat', max_streams=1)}"}
        config = SwitchyardConfig(
            data_dir=tmp_path, nats_url=nats_url, database_url=url,
            gateway=GatewayConfig(port=free_port()),
            worker=WorkerConfig(model=str(save_tiny_model(tmp_path / "model")), served_model_name=MODEL,
                                dtype="float32", max_num_seqs=4))
        with LocalSystem(config, log_dir=tmp_path, log_level="INFO") as system:
            system.start_worker()
            system.start_gateway()
            system.wait_until_ready(MODEL, timeout_s=120)
            async with httpx.AsyncClient(base_url=system.url(), timeout=30) as http:
                for headers in (known, one_seat):
                    assert (await http.post("/v1/chat/completions", json=BODY, headers=headers)).status_code == 200
                conv = (await http.post("/v1/conversations", json={"model": MODEL}, headers=known)).json()["id"]

                # Hung: a conversation turn streams while Postgres stops answering; its write is held.
                stopped = _process_tree(pg.pid)
                turn = {"content": "tell me a story", "max_tokens": 200, "ignore_eos": True, "stream": True}
                async with http.stream("POST", f"/v1/conversations/{conv}/messages", json=turn,
                                       headers=known) as r:
                    assert r.status_code == 200
                    for pid in stopped:
                        os.kill(pid, signal.SIGSTOP)
                    events = [line async for line in r.aiter_lines() if line.startswith("data: {")]
                assert all("error" not in json.loads(e[6:]) for e in events)
                served = await _served_while_away(http, known, unknown)
                for pid in stopped:
                    os.kill(pid, signal.SIGCONT)

                # Down: stopped outright, then started again on the same data. A stored response is answered and
                # held meanwhile.
                pg.stop()
                served += await _served_while_away(http, known, unknown)
                r = await http.post("/v1/responses", headers=known, json={
                    "model": MODEL, "input": "hi", "max_output_tokens": 3, "store": True})
                assert r.status_code == 200, r.text
                response = r.json()
                served.append(r.headers["X-Request-Id"])
                # A background response cannot be stored, so it is refused after it was admitted: the seat it
                # took goes back (a tenant allowed one stream at a time is served next, not told it has one).
                r = await http.post("/v1/responses", headers=one_seat, json={
                    "model": MODEL, "input": "hi", "max_output_tokens": 3, "background": True})
                assert r.status_code == 503 and r.json()["error"]["code"] == "database_unavailable", r.text
                r = await http.post("/v1/chat/completions", json=BODY, headers=one_seat)
                assert r.status_code == 200, r.text
                served.append(r.headers["X-Request-Id"])
                pg = PostgresServer(pg_dir, port=pg_port, ephemeral=True).start()

                # Back: the unknown key works, and everything written meanwhile lands, once.
                ok = await poll(lambda: http.post("/v1/chat/completions", json=BODY, headers=unknown),
                                lambda r: r.status_code == 200, timeout_s=30, interval_s=0.5,
                                what="the unknown key served once Postgres is back")
                assert ok.status_code == 200
                rows = await poll(lambda: _rows(url, served), lambda rows: len(rows) == len(served), timeout_s=60,
                                  what=lambda rows: f"{len(rows)} of {len(served)} usage rows")
                assert sorted(r["request_id"] for r in rows) == sorted(served)
                messages = await poll(
                    lambda: http.get(f"/v1/conversations/{conv}/messages", headers=known),
                    lambda r: r.status_code == 200 and len(r.json()["data"]) == 2, timeout_s=60,
                    what="the held turn written")
                roles = [m["role"] for m in messages.json()["data"]]
                assert sorted(roles) == ["assistant", "user"]
                stored = await poll(lambda: http.get(f"/v1/responses/{response['id']}", headers=known),
                                    lambda r: r.status_code == 200, timeout_s=60, what="the held response written")
                assert stored.json()["output"] == response["output"]
    finally:
        for pid in _process_tree(pg.pid) if pg._proc is not None else []:
            os.kill(pid, signal.SIGCONT)
        pg.stop()
        nats_server.stop()
        shutil.rmtree(pg_dir, ignore_errors=True)
