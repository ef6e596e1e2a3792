"""The worker's HTTP port on its own: metrics, liveness, readiness through start and drain, and /drain holding its
answer until the worker says it has drained."""

from __future__ import annotations

import threading
import time

import httpx
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.parser import text_string_to_metric_families

from switchyard.shared.tiers import INTERACTIVE_TIERS
from switchyard.workers.service.intake import SLOW_PREPARE_S, Intake
from switchyard.workers.service.metrics import WorkerMetrics
from switchyard.workers.service.status_server import StatusServer, WorkerStatus
from switchyard.workers.service.stream_replay import StreamReplays


def test_probes_follow_the_worker_and_drain_answers_once_drained():
    registry = CollectorRegistry()
    Counter("switchyard:probe_test", "a counter", registry=registry).inc(3)
    status = WorkerStatus(drain_timeout_s=30)
    asked = threading.Event()
    status.request_drain = asked.set
    server = StatusServer(registry, status, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{server.port}"
    try:
        with httpx.Client(timeout=60) as http:
            assert http.get(f"{url}/healthz").status_code == 200
            starting = http.get(f"{url}/readyz")
            assert (starting.status_code, starting.text) == (503, "starting\n")
            status.ready.set()
            assert http.get(f"{url}/readyz").status_code == 200
            metrics = http.get(f"{url}/metrics")
            assert metrics.status_code == 200 and "switchyard:probe_test_total 3.0" in metrics.text
            assert http.get(f"{url}/nope").status_code == 404

            answers = []
            drain = threading.Thread(target=lambda: answers.append(http.get(f"{url}/drain")))
            drain.start()
            assert asked.wait(10), "/drain must ask the worker to stop"
            status.draining.set()
            draining = http.get(f"{url}/readyz")
            assert (draining.status_code, draining.text) == (503, "draining\n")
            assert not answers, "/drain answers only once the worker has drained"
            status.drained.set()
            drain.join(10)
            assert (answers[0].status_code, answers[0].text) == (200, "drained\n")
    finally:
        server.stop()


def test_drain_wants_loopback_or_the_token_and_metrics_the_token_once_set():
    registry = CollectorRegistry()
    status = WorkerStatus(drain_timeout_s=1)
    asked = threading.Event()
    status.request_drain = asked.set
    status.drained.set()
    server = StatusServer(registry, status, "127.0.0.1", 0, token="s3cret")
    url = f"http://127.0.0.1:{server.port}"
    try:
        with httpx.Client(timeout=30) as http:
            assert http.get(f"{url}/metrics").status_code == 401
            assert http.get(f"{url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
            assert http.get(f"{url}/metrics", headers={"Authorization": "Bearer s3cret"}).status_code == 200
            assert http.get(f"{url}/readyz").status_code == 503  # probes need no credential
            # A peer in the pod (the preStop hook) may drain without the token.
            assert http.get(f"{url}/drain").status_code == 200 and asked.is_set()
    finally:
        server.stop()


def test_a_drain_from_another_host_needs_the_token():
    from switchyard.workers.service.status_server import _wsgi_app

    status = WorkerStatus(drain_timeout_s=1)
    asked = []
    status.request_drain = lambda: asked.append(True)
    status.drained.set()

    def get(app, remote: str, authorization: str = "") -> str:
        answered = []
        environ = {"PATH_INFO": "/drain", "REQUEST_METHOD": "POST", "REMOTE_ADDR": remote}
        if authorization:
            environ["HTTP_AUTHORIZATION"] = authorization
        app(environ, lambda code, headers: answered.append(code))
        return answered[0]

    open_app, guarded = _wsgi_app(CollectorRegistry(), status, ""), _wsgi_app(CollectorRegistry(), status, "s3cret")
    assert get(open_app, "10.1.2.3").startswith("403") and get(guarded, "10.1.2.3").startswith("403")
    assert get(guarded, "10.1.2.3", "Bearer nope").startswith("403")
    assert not asked  # nobody off the host stopped the worker
    assert get(guarded, "10.1.2.3", "Bearer s3cret").startswith("200") and asked


class StubConnection:
    def new_inbox(self) -> str:
        return "_INBOX.test"


def test_metrics_carry_what_the_worker_holds_per_tenant_as_it_is_when_scraped():
    """The intake and the stream replays watched as the worker watches them (workers/service/worker.py): one
    ``switchyard:tenant_state_entries`` sample per structure, read at each scrape from the server's thread."""
    metrics = WorkerMetrics("m")
    intake = Intake(None, StubConnection(), None, "m", "w", held=None, capacity=None, out=None)
    replays = StreamReplays("w", time.monotonic())
    metrics.tenant_state.watch("intake", intake.tenant_state)
    metrics.tenant_state.watch("stream_replays", replays.tenant_state)
    status = WorkerStatus(drain_timeout_s=1)
    server = StatusServer(metrics.registry, status, "127.0.0.1", 0)

    def scraped(http: httpx.Client) -> dict[str, float]:
        text = http.get(f"http://127.0.0.1:{server.port}/metrics").text
        [family] = [f for f in text_string_to_metric_families(text) if f.name == "switchyard:tenant_state_entries"]
        return {sample.labels["structure"]: sample.value for sample in family.samples}

    try:
        with httpx.Client(timeout=30) as http:
            assert set(scraped(http).values()) == {0}
            for tenant in ("a", "b"):
                assert intake.queues.ring(f"llm.req.m.{INTERACTIVE_TIERS[0]}.{tenant}")
            intake.queues.charge(INTERACTIVE_TIERS[0], "a", prompt_tokens=10)
            intake._note_cost("a", SLOW_PREPARE_S * 2, time.monotonic())
            assert scraped(http) == {
                "queue_pending_tenants": 2, "queue_rings": 2, "queue_unmatched": 2, "queue_consumers": 0,
                "fair_share_counters": 1, "fair_share_costs": 0, "fair_share_backlogged": 0, "slow_lane_tenants": 1,
                "resumable_streams": 0, "resume_gone": 0}
    finally:
        server.stop()
        intake.shutdown()
