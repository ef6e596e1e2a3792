"""The worker's HTTP port (``worker.metrics_port``): what an operator, Prometheus and Kubernetes ask of a worker.

| path       | answers                                                                                     |
|------------|---------------------------------------------------------------------------------------------|
| /metrics   | Prometheus text (workers/service/metrics.py); with ``worker.status_token``, to its bearer only |
| /healthz   | 200 while the process lives (liveness)                                                      |
| /readyz    | 200 once the model is loaded and requests are pulled, 503 before that and while draining    |
| /drain     | starts a drain (stop pulling, finish what runs) and answers 200 once drained: a preStop hook |
|            | in the pod (loopback), or the bearer of ``worker.status_token``; anyone else gets 403        |

A worker has no Service traffic to take away (it pulls its work), so readiness tells a rollout when a new worker
really serves, and ``/drain`` lets Kubernetes' preStop hook hold the pod until its running requests are done.
The server runs in its own threads: a scrape or a probe never waits on the event loop or the step thread. Probes
stay open (kubelet sends no credential); a drain takes a worker out of service, so a peer on the network needs the
token for it (deploy/k8s/base/worker-networkpolicy.yaml admits Prometheus and the gateways to this port at all).
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

log = logging.getLogger("switchyard.worker")


class WorkerStatus:
    """The worker's state as its HTTP port reports it; set from the event loop, read from the server's threads."""

    def __init__(self, drain_timeout_s: float) -> None:
        self.ready = threading.Event()  # pulling requests
        self.draining = threading.Event()  # stop asked for: no new requests
        self.drained = threading.Event()  # nothing runs any more (or the drain timed out)
        self.drain_timeout_s = drain_timeout_s
        self.request_drain: Callable[[], object] = lambda: None  # set by the worker's process: sets its stop event

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and not self.draining.is_set()


class _Server(ThreadingMixIn, WSGIServer):
    # Handler threads are joined on close, so a preStop hook waiting on /drain gets its answer before the process
    # ends (each handler is short: a drain waits at most its timeout).
    daemon_threads = False
    block_on_close = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format, *args) -> None:  # probes and scrapes every few seconds are not news
        pass


def _bearer_ok(environ, token: str) -> bool:
    given = environ.get("HTTP_AUTHORIZATION", "").removeprefix("Bearer ").strip()
    return bool(token) and hmac.compare_digest(given.encode(), token.encode())


def _from_loopback(environ) -> bool:
    try:
        return ipaddress.ip_address(environ.get("REMOTE_ADDR", "")).is_loopback
    except ValueError:
        return False


def _wsgi_app(registry: CollectorRegistry, status: WorkerStatus, token: str):
    metrics_app = make_wsgi_app(registry)

    def plain(start_response, code: str, body: str) -> list[bytes]:
        start_response(code, [("Content-Type", "text/plain; charset=utf-8")])
        return [body.encode()]

    def app(environ, start_response):
        path = environ.get("PATH_INFO", "/")
        if path == "/metrics":
            if token and not _bearer_ok(environ, token):
                return plain(start_response, "401 Unauthorized", "a bearer token is required\n")
            return metrics_app(environ, start_response)
        if path == "/healthz":
            return plain(start_response, "200 OK", "ok\n")
        if path == "/readyz":
            if status.is_ready:
                return plain(start_response, "200 OK", "ready\n")
            return plain(start_response, "503 Service Unavailable",
                         "draining\n" if status.draining.is_set() else "starting\n")
        if path == "/drain":
            if environ.get("REQUEST_METHOD") not in ("GET", "POST"):
                return plain(start_response, "405 Method Not Allowed", "GET or POST\n")
            if not (_from_loopback(environ) or _bearer_ok(environ, token)):
                return plain(start_response, "403 Forbidden", "drain from the worker's own host, or with its token\n")
            log.info("drain asked for over HTTP")
            status.request_drain()
            # A margin over the worker's own deadline, by which it has ended what still ran.
            drained = status.drained.wait(status.drain_timeout_s + 10)
            return plain(start_response, "200 OK", "drained\n" if drained else "still draining\n")
        return plain(start_response, "404 Not Found", "not found\n")

    return app


class StatusServer:
    """Serves the paths above on ``host:port`` (0: any free port) until ``stop``; ``token``: see the table."""

    def __init__(self, registry: CollectorRegistry, status: WorkerStatus, host: str, port: int,
                 token: str = "") -> None:
        self._server = make_server(host, port, _wsgi_app(registry, status, token), _Server,
                                   handler_class=_QuietHandler)
        self.port = self._server.server_port
        self._thread = threading.Thread(target=self._server.serve_forever, name="switchyard-status", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
