"""A three-node JetStream cluster (three real nats-server processes, streams and buckets at R3) under a running
system: killing the node that leads the request stream, under steady load, loses no accepted request and no usage
record, and bills none twice. Every request is answered: served, or refused with an OpenAI error and a reason."""

from __future__ import annotations

import asyncio

import asyncpg
import httpx
import nats

from switchyard.deploy.nats_cluster import NatsCluster
from switchyard.deploy.system import LocalSystem
from switchyard.shared import nats_client, subjects
from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
from tests.support.system import free_port, make_key, poll
from tests.support.tiny_model import save_tiny_model

MODEL = "tiny-cluster"
NUM_REQUESTS = 60
CONCURRENCY = 6


async def _stream_leader(url: str) -> str:
    nc = await nats_client.connect(url, "test-cluster-probe", reconnect_forever=False)
    try:
        return (await nc.jetstream().stream_info(subjects.request_stream("pro"))).cluster.leader
    finally:
        await nc.close()


async def test_killing_the_stream_leader_under_load_loses_and_doubles_nothing(database_url, tmp_path):
    cluster = NatsCluster(tmp_path / "nats", size=3).start()
    config = SwitchyardConfig(
        data_dir=tmp_path, nats_url=cluster.url, nats_replicas=3, database_url=database_url,
        gateway=GatewayConfig(port=free_port(), queue_timeout_s=30),
        worker=WorkerConfig(model=str(save_tiny_model(tmp_path / "model")), served_model_name=MODEL,
                            dtype="float32", max_num_seqs=4))
    system = LocalSystem(config, log_dir=tmp_path, log_level="INFO")
    tenant = "cluster-load"
    headers = {"Authorization": f"Bearer {await make_key(database_url, tenant)}"}
    try:
        system.start_worker()
        system.start_gateway()
        system.wait_until_ready(MODEL, timeout_s=120)
        nc = await nats.connect(cluster.url.split(","))
        info = await nc.jetstream().stream_info(subjects.request_stream("pro"))
        await nc.close()
        assert info.config.num_replicas == 3 and len(info.cluster.replicas) == 2

        answers: list[httpx.Response] = []
        killed = asyncio.Event()

        async def client(http: httpx.AsyncClient, todo: list[int]) -> None:
            while todo:
                i = todo.pop()
                body = {"model": MODEL, "prompt": f"request {i}", "max_tokens": 12, "ignore_eos": True,
                        "temperature": 0}
                answers.append(await http.post("/v1/completions", json=body))

        async def killer() -> None:
            await poll(lambda: asyncio.sleep(0, len(answers)), lambda n: n >= NUM_REQUESTS // 4, timeout_s=120,
                       what="a quarter of the requests answered")
            leader = await _stream_leader(cluster.url)
            cluster.kill(leader)
            killed.set()

        todo = list(range(NUM_REQUESTS))
        async with httpx.AsyncClient(base_url=system.url(), headers=headers, timeout=90) as http:
            await asyncio.gather(killer(), *(client(http, todo) for _ in range(CONCURRENCY)))
        assert killed.is_set()

        assert len(answers) == NUM_REQUESTS  # none hung, none dropped without an answer
        served = [r for r in answers if r.status_code == 200]
        refused = [r for r in answers if r.status_code != 200]
        print(f"served {len(served)}, refused {[(r.status_code, r.json()['error']['message']) for r in refused]}")
        for r in refused:  # refused with a reason a client can act on (retry), never a 500
            assert r.status_code in (429, 503) and r.json()["error"]["code"], r.text
        assert len(served) >= NUM_REQUESTS - CONCURRENCY  # at most the requests in flight at the kill

        # Billing: each served request exactly once, with the tokens its client was told.
        conn = await asyncpg.connect(database_url)
        try:
            ids = [r.headers["X-Request-Id"] for r in served]
            rows = await poll(lambda: conn.fetch("SELECT request_id, completion_tokens FROM requests "
                                                 "WHERE request_id = ANY($1)", ids),
                              lambda rows: len(rows) == len(ids), timeout_s=60,
                              what=lambda rows: f"{len(rows)} of {len(ids)} usage rows")
            assert {row["request_id"]: row["completion_tokens"] for row in rows} == dict.fromkeys(ids, 12)
            tenant_rows = await conn.fetchval("SELECT count(*) FROM requests r JOIN tenants t ON t.id = r.tenant_id "
                                              "WHERE t.name = $1", tenant)
            assert tenant_rows <= NUM_REQUESTS
        finally:
            await conn.close()
    finally:
        system.stop()
        cluster.stop()
