"""The gateway's Prometheus metrics: what clients see (first token, token intervals, whole requests, errors by
reason), and what sits in JetStream and Postgres (queue depth, oldest wait and token backlog per model and tier,
billing writer lag, batch lines by state; see ``gateway/queue_metrics.py``), served on ``GET /metrics``.

Latencies are measured here, not in the worker, because the client's clock starts when the gateway accepts the
request: a first token includes its time in the JetStream queue.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from switchyard.shared.gc_pauses import pause_histogram
from switchyard.shared.messages import GenerateRequest, TokenDelta
from switchyard.shared.metrics import LATENCY_BUCKETS, LOOP_LAG_BUCKETS, REQUEST_BUCKETS, TOKEN_INTERVAL_BUCKETS, name
from switchyard.shared.tenant_state import TenantStateCollector

_LABELS = ("model", "tier")


class GatewayMetrics:
    """One gateway's metrics, in a registry of their own (several gateways may share a process in tests)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.ttft = Histogram(name("time_to_first_token_seconds"),
                              "From the gateway accepting a request to its first token reaching it.", _LABELS,
                              buckets=LATENCY_BUCKETS, registry=r)
        # Before the TTFT above begins: a client's own TTFT is this plus that (plus its network and the body read).
        self.admission = Histogram(name("admission_seconds"),
                                   "How long admission took (domain/admission/: the key's limits, the tier's queue "
                                   "and the tenant's quotas checked, its seat reserved in Postgres), by tier and "
                                   "outcome: admitted, refused.", ("tier", "outcome"), buckets=LOOP_LAG_BUCKETS,
                                   registry=r)
        self.itl = Histogram(name("inter_token_latency_seconds"), "Time between two tokens of one stream.", _LABELS,
                             buckets=TOKEN_INTERVAL_BUCKETS, registry=r)
        self.e2e = Histogram(name("e2e_request_latency_seconds"),
                             "From the gateway accepting a request to its last token (requests that finished).",
                             _LABELS, buckets=REQUEST_BUCKETS, registry=r)
        self.errors = Counter(name("request_errors"),
                              "Requests answered with an error (HTTP status, or an error event in a stream), by "
                              "status and error code: 429 queue_full, rate_limit_exceeded, insufficient_quota, 503 "
                              "queue_timeout, worker_lost, database_unavailable, ...", (*_LABELS, "status", "reason"),
                              registry=r)
        self.queue_depth = Gauge(name("queue_depth"), "Requests waiting in the tier's JetStream queue.", _LABELS,
                                 registry=r)
        self.queue_oldest_age = Gauge(name("queue_oldest_age_seconds"), "Age of the oldest queued request.", _LABELS,
                                      registry=r)
        self.queue_backlog_tokens = Gauge(name("queue_backlog_tokens"),
                                          "Tokens the queued requests may use (estimated as admission reserves them: "
                                          "prompt characters / 4 + max_tokens).", _LABELS, registry=r)
        self.billing_lag_records = Gauge(name("billing_lag_records"),
                                         "Usage records not yet written to Postgres.", registry=r)
        self.billing_lag_seconds = Gauge(name("billing_lag_seconds"),
                                         "Age of the oldest usage record not yet written to Postgres.", registry=r)
        self.batch_lines = Gauge(name("batch_lines"), "Lines of batches not yet ended, by state.", ("state",),
                                 registry=r)
        self.safety_input = Counter(name("safety_input_verdicts"),
                                    "Requests judged by the input safety filter (domain/admission/safety.py), by tier, "
                                    "category (none: allowed) and action: allowed, logged, blocked.",
                                    ("tier", "category", "action"), registry=r)
        self.loop_lag = Histogram(name("event_loop_lag_seconds"),
                                  "How late a timer fires on the gateway's event loop (gateway/loop_lag.py): every "
                                  "await of every request it serves is late by as much.", buckets=LOOP_LAG_BUCKETS,
                                  registry=r)
        self.hedges_started = Counter(name("hedges_started"),
                                      "Requests offered to a second worker for want of a first token "
                                      "(gateway/hedging.py).", _LABELS, registry=r)
        self.hedges_won = Counter(name("hedges_won"), "Hedged requests whose first token came from the second worker.",
                                  _LABELS, registry=r)
        self.hedges_lost = Counter(name("hedges_lost"), "Hedged requests whose first token came from the first worker.",
                                   _LABELS, registry=r)
        self.hedges_skipped = Counter(name("hedges_skipped"),
                                      "Requests due a hedge that got none, by reason: budget (the tier's share "
                                      "spent), no_free_seat (no other worker had a seat free).",
                                      (*_LABELS, "reason"), registry=r)
        self.gc_pauses = pause_histogram(r)
        # What the gateway holds per tenant, key or conversation (shared/tenant_state.py): its services and
        # middleware watch it when they are made.
        self.tenant_state = TenantStateCollector()
        r.register(self.tenant_state)
        self.served_models: set[str] = set()  # names a model label may take (the registry's), see model_label

    def model_label(self, model: str | None) -> str:
        """A client-named model as a label: only a served model's name, so a client cannot mint series."""
        return model if model in self.served_models else ""

    def error(self, model: str | None, tier: str | None, status: int, reason: str | None) -> None:
        self.errors.labels(self.model_label(model), tier or "", str(status), reason or "").inc()

    def stream(self, request: GenerateRequest) -> StreamTimer:
        return StreamTimer(self, request)


class StreamTimer:
    """Times one request's deltas as they reach the gateway."""

    __slots__ = ("_metrics", "_labels", "_itl", "_created_at", "_last_token_at", "_errored")

    def __init__(self, metrics: GatewayMetrics, request: GenerateRequest) -> None:
        self._metrics = metrics
        self._labels = (metrics.model_label(request.model), request.tier)
        self._itl = metrics.itl.labels(*self._labels)  # found once: a labels() lookup per delta adds up
        self._created_at = request.created_at
        self._last_token_at: float | None = None
        self._errored = False

    def delta(self, delta: TokenDelta) -> None:
        now = time.time()
        if delta.error is not None:
            self._errored = True
            self._metrics.error(self._labels[0], self._labels[1], delta.error.status, delta.error.code)
            return
        if not delta.num_tokens:
            return
        itl, intervals = self._itl, delta.num_tokens
        if self._last_token_at is None:
            self._metrics.ttft.labels(*self._labels).observe(max(0.0, now - self._created_at))
            intervals -= 1
            interval = 0.0
        else:
            interval = (now - self._last_token_at) / delta.num_tokens
        # Tokens held back together (an incomplete character, a possible stop string) arrive in one delta: one
        # interval per token after the first, as a client reading them one by one would count them.
        for _ in range(intervals):
            itl.observe(interval)
        self._last_token_at = now

    def finished(self) -> None:
        """Every choice ended (not an error, not a client that went away)."""
        if not self._errored:
            self._metrics.e2e.labels(*self._labels).observe(max(0.0, time.time() - self._created_at))
