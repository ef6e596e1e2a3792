"""The worker's HTTP port on its own: metrics, liveness, readiness through start and drain, and /drain holding its
answer until the worker says it has drained."""

from __future__ import annotations

import threading

import httpx
from prometheus_client import CollectorRegistry, Counter

from switchyard.workers.service.status_server import StatusServer, WorkerStatus


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
