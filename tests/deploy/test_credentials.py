"""The embedded servers' credentials: NATS refuses anonymous clients and holds each role to its subjects, Postgres
asks for the password, secrets files are the owner's only, and no secret shows on any process's command line while
a whole system serves through them."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import stat
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import httpx
import nats
import pytest
from nats.errors import NoServersError
from nats.js.api import ConsumerConfig, StreamConfig

from switchyard.deploy.credentials import (
    NATS_CONFIG_FILE,
    SECRETS_FILE,
    load_or_create,
    with_credentials,
    write_nats_config,
)
from switchyard.deploy.db_roles import APP_ROLE
from switchyard.deploy.launcher import NatsServer
from switchyard.deploy.processes import pid_alive
from switchyard.deploy.system import LocalSystem
from switchyard.deploy.up import RUN_FILE, write_run_file
from switchyard.domain.queues import billing_lag, queue_state
from switchyard.shared import nats_client, subjects
from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
from switchyard.shared.jetstream import ensure_request_consumer, ensure_streams, ensure_usage_consumer
from switchyard.shared.messages import GenerateRequest, SamplingParams, UsageRecord, encode
from tests.support.system import free_port, make_key, poll
from tests.support.tiny_model import save_tiny_model


@pytest.fixture
def data_dir():
    path = Path(tempfile.mkdtemp(prefix="switchyard-test-creds-"))
    path.chmod(0o755)  # postgres runs as nobody under root
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def _received(sub, timeout: float = 0.5) -> bool:
    try:
        await sub.next_msg(timeout=timeout)
        return True
    except (TimeoutError, nats.errors.TimeoutError):
        return False


async def test_nats_refuses_anonymous_clients_and_holds_each_role_to_its_subjects(data_dir):
    creds = load_or_create(data_dir)
    conf = write_nats_config(data_dir / NATS_CONFIG_FILE, creds)
    with NatsServer(data_dir / "nats", extra_args=["-c", str(conf)]) as server:
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            await nats.connect(server.url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=2)

        def url(role):
            return with_credentials(server.url, role, creds.nats_passwords[role])

        violations = []

        async def note(error):  # the server answers a forbidden publish with a permissions violation
            violations.append(str(error))

        admin = await nats.connect(url("admin"))
        gateway = await nats.connect(url("gateway"), error_cb=note)
        worker = await nats.connect(url("worker"), error_cb=note)
        try:
            requests = await admin.subscribe("llm.req.>")
            tokens = await admin.subscribe("llm.tok.>")
            await nats_client.settled(admin)
            for client, subject in ((worker, "llm.req.m.pro"), (gateway, "llm.tok.r1")):  # forged: dropped
                await client.publish(subject, b"forged")
                await nats_client.settled(client)
            assert not await _received(requests) and not await _received(tokens)
            assert sorted(violations) == ['nats: permissions violation for publish to "llm.req.m.pro"',
                                       'nats: permissions violation for publish to "llm.tok.r1"'], violations
            await gateway.publish("llm.req.m.pro", b"ok")
            await worker.publish("llm.tok.r1", b"ok")
            await nats_client.settled(gateway)
            await nats_client.settled(worker)
            assert await _received(requests, 5) and await _received(tokens, 5)
            # A stream taken over (gateway/stream_resume.py): the worker hears the gateways' pings and answers
            # their asks, the gateway gets the answer.
            async def answer(msg) -> None:
                await msg.respond(b"answer")

            pings = await worker.subscribe("llm.gw.alive.>")
            asks = await worker.subscribe("llm.resume.>", cb=answer)
            await nats_client.settled(worker)
            await gateway.publish("llm.gw.alive.g1", b"")
            assert (await gateway.request("llm.resume.r1", b"ask", timeout=5)).data == b"answer"
            assert await _received(pings, 5)
            await asks.unsubscribe()
            assert len(violations) == 2, violations
        finally:
            for client in (admin, gateway, worker):
                await client.close()


async def test_neither_service_role_can_purge_delete_or_drain_the_usage_stream(data_dir):
    creds = load_or_create(data_dir)
    conf = write_nats_config(data_dir / NATS_CONFIG_FILE, creds)
    with NatsServer(data_dir / "nats", extra_args=["-c", str(conf)]) as server:
        clients = {role: await nats.connect(with_credentials(server.url, role, creds.nats_passwords[role]),
                                            error_cb=_ignore)
                   for role in ("admin", "gateway", "worker")}
        try:
            js = {role: nc.jetstream(timeout=1) for role, nc in clients.items()}
            await ensure_streams(js["gateway"])  # a gateway sets the streams up with its own role
            await ensure_streams(js["worker"], seed=False)  # and a worker starting first could too
            await js["worker"].publish(subjects.USAGE_SUBJECT, b"a usage record")
            for role in ("worker", "gateway"):
                for attack in (lambda j: j.purge_stream(subjects.USAGE_STREAM),
                               lambda j: j.delete_stream(subjects.USAGE_STREAM),
                               lambda j: j.update_stream(StreamConfig(name=subjects.USAGE_STREAM,
                                                                      subjects=[subjects.USAGE_SUBJECT], max_msgs=0))):
                    with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
                        await attack(js[role])  # the server drops the request: no answer
            with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):  # nor read it as its own
                await js["worker"].add_consumer(subjects.USAGE_STREAM, ConsumerConfig(durable_name="mine"))
            info = await js["admin"].stream_info(subjects.USAGE_STREAM)
            assert info.state.messages == 1  # the record is still there for the billing writer
            # What a worker does need, it may: its tenant queues' consumers, pulled from.
            name = await ensure_request_consumer(js["worker"], "m", "pro", "acme")
            await js["gateway"].publish(subjects.request_subject("m", "pro", "acme"), b"a request")
            sub = await js["worker"].pull_subscribe_bind(name, stream=subjects.request_stream("pro"))
            [msg] = await sub.fetch(1, timeout=5)
            await msg.ack()
            assert msg.data == b"a request"
        finally:
            for nc in clients.values():
                await nc.close()


async def test_the_gateway_role_reads_its_queue_gauges_and_billing_lag(data_dir):
    """The gateway reads queued requests (the oldest one's age and the backlog, which KEDA scales workers on) and
    the oldest unbilled usage record by sequence: its role must allow those reads, or the gauges stay empty and
    nats-server logs a violation every scrape."""
    creds = load_or_create(data_dir)
    conf = write_nats_config(data_dir / NATS_CONFIG_FILE, creds)
    with NatsServer(data_dir / "nats", extra_args=["-c", str(conf)]) as server:
        violations = []

        async def note(error):
            violations.append(str(error))

        gateway = await nats.connect(with_credentials(server.url, "gateway", creds.nats_passwords["gateway"]),
                                     error_cb=note)
        worker = await nats.connect(with_credentials(server.url, "worker", creds.nats_passwords["worker"]),
                                    error_cb=note)
        try:
            js, worker_js = gateway.jetstream(timeout=2), worker.jetstream(timeout=2)
            await ensure_streams(js)
            await ensure_usage_consumer(js)
            request = GenerateRequest(request_id="r1", model="m", tier="pro", created_at=time.time(),
                                      deadline_at=time.time() + 60, prompt="x" * 400,
                                      sampling=SamplingParams(max_tokens=100))
            await js.publish(subjects.request_subject("m", "pro", "acme"), encode(request))
            state = await queue_state(js, "m", "pro")
            assert state.depth == 1 and state.oldest_age_s is not None and state.backlog_tokens >= 100
            record = UsageRecord(request_id="r0", model="m", tier="pro", prompt_tokens=1, completion_tokens=1,
                                 finish_reason="stop", created_at=time.time() - 5, queue_ms=0, first_token_ms=1,
                                 total_ms=10)
            await worker_js.publish(subjects.USAGE_SUBJECT, encode(record))
            pending, age_s = await billing_lag(js)
            assert pending == 1 and age_s > 0
            assert not violations, violations
        finally:
            for nc in (gateway, worker):
                await nc.close()


async def _ignore(error):  # the permission violations the test provokes
    pass


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make a certificate")
async def test_nats_over_tls_with_a_private_ca(data_dir):
    cert, key = data_dir / "cert.pem", data_dir / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    creds = load_or_create(data_dir)
    conf = write_nats_config(data_dir / NATS_CONFIG_FILE, creds, tls_cert=cert, tls_key=key)
    with NatsServer(data_dir / "nats", extra_args=["-c", str(conf)]) as server:
        url = with_credentials(server.url, "admin", creds.nats_passwords["admin"], scheme="tls")
        nc = await nats_client.connect(url, "test-tls", reconnect_forever=False, tls_ca=cert)
        try:
            assert nc.is_connected and nc.connected_url.scheme == "tls"
        finally:
            await nc.close()
        # The server's certificate is not one the system trusts: the client never gets through (nats-py keeps
        # retrying the handshake rather than raise, so the test bounds it).
        with pytest.raises((asyncio.TimeoutError, nats.errors.Error, OSError)):
            await asyncio.wait_for(nats_client.connect(url, "test-tls-untrusted", reconnect_forever=False), 5)


def test_a_system_serves_through_its_credentials_and_shows_no_secret(data_dir):
    """Synchronous: starting the servers runs the migrations in an event loop of its own."""
    config = SwitchyardConfig(
        data_dir=data_dir, gateway=GatewayConfig(port=free_port()),
        worker=WorkerConfig(model=str(save_tiny_model(data_dir / "model")), served_model_name="tiny-creds",
                            dtype="float32", max_num_seqs=2))
    with LocalSystem(config, log_dir=data_dir, ephemeral=True) as system:
        system.start_servers()
        creds = load_or_create(data_dir)
        for name in (SECRETS_FILE, NATS_CONFIG_FILE):
            assert stat.S_IMODE((data_dir / name).stat().st_mode) == 0o600
        write_run_file(data_dir, config.nats_url, config.database_url)
        assert stat.S_IMODE((data_dir / RUN_FILE).stat().st_mode) == 0o600

        without_password = config.database_url.replace(f":{creds.postgres_password}@", "@")
        with pytest.raises(asyncpg.InvalidPasswordError):
            asyncio.run(asyncpg.connect(without_password))

        system.start_worker()
        system.start_gateway()
        system.wait_until_ready("tiny-creds", timeout_s=120)
        key = asyncio.run(make_key(config.database_url, "creds", "pro"))
        with httpx.Client(base_url=system.url(), timeout=60, headers={"Authorization": f"Bearer {key}"}) as http:
            body = {"model": "tiny-creds", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
                    "stream": True}
            with http.stream("POST", "/v1/chat/completions", json=body) as r:
                lines = [line for line in r.iter_lines() if line.startswith("data: ")]
            assert r.status_code == 200 and lines[-1] == "data: [DONE]"
            request_id = r.headers["X-Request-Id"]
            # A second turn with that history is offered to the worker that served the first (llm.aff.>).
            reply = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                            for line in lines[:-1] if json.loads(line[6:])["choices"])
            follow_up = {**body, "stream": False, "messages": [*body["messages"],
                                                               {"role": "assistant", "content": reply},
                                                               {"role": "user", "content": "and then?"}]}
            assert http.post("/v1/chat/completions", json=follow_up).status_code == 200

        async def billed():  # the billing writer (a gateway job) consumed the worker's usage record
            conn = await asyncpg.connect(config.database_url)
            try:
                return await poll(lambda: conn.fetchval("SELECT count(*) FROM requests WHERE request_id = $1",
                                                        request_id), timeout_s=30, what="the usage row")
            finally:
                await conn.close()
        assert asyncio.run(billed()) == 1
        # The services use Postgres as a role that touches rows only; the superuser's password is the migrations'.
        envs = {svc.name: svc.env for svc in system.services}
        assert {name: urlsplit(env["SWITCHYARD_DATABASE_URL"]).username for name, env in envs.items()
                if name != "worker"} == {"gateway": APP_ROLE, "jobs": APP_ROLE}
        assert not envs["worker"].get("SWITCHYARD_DATABASE_URL")  # a worker needs no database

        async def app_role_rights():
            conn = await asyncpg.connect(envs["gateway"]["SWITCHYARD_DATABASE_URL"])
            try:
                assert await conn.fetchval("SELECT rolsuper OR rolcreaterole OR rolcreatedb FROM pg_roles "
                                           "WHERE rolname = current_user") is False
                for ddl in ("DROP TABLE requests", "ALTER TABLE requests DISABLE TRIGGER ALL",
                            "CREATE TABLE mine (x int)", "TRUNCATE requests"):
                    with pytest.raises(asyncpg.InsufficientPrivilegeError):
                        await conn.execute(ddl)
            finally:
                await conn.close()
        asyncio.run(app_role_rights())
        # Every role had every subject it used: the server refused nothing.
        assert "Permissions Violation" not in (data_dir / "nats" / "nats-server.log").read_text()

        secrets_ = [creds.postgres_password, *creds.nats_passwords.values()]
        pids = [svc.pid for svc in system.services]
        for pid in pids + [int(p) for p in os.listdir("/proc") if p.isdigit()]:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            assert not any(s in cmdline for s in secrets_), f"a secret on the command line of {pid}: {cmdline}"
        started = system.pids()
        assert started.keys() == {"nats", "postgres", "worker", "gateway", "jobs"}
    # Stopped by PID, every one: none is left running (a zombie has stopped too).
    assert not [name for name, pid in started.items() if pid_alive(pid)]
