"""A worker's Prometheus metrics, served on its own port (``worker.metrics_port``, workers/service/status_server.py;
its URL is in the worker registry, so ``switchyard top`` and an operator find it).

Load and cache gauges and the engine's counters come from the ``EngineStats`` snapshot of the last step
(taken on the step thread, so a scrape never reads the scheduler while it changes); per-request numbers are
observed as the event loop publishes each step's outcome.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from switchyard.shared.gc_pauses import pause_histogram
from switchyard.shared.metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS, TOKEN_INTERVAL_BUCKETS, name
from switchyard.shared.tenant_state import TenantStateCollector
from switchyard.shared.tiers import TIER_NAMES
from switchyard.workers.serving.stats import EngineStats

log = logging.getLogger("switchyard.worker")


class WorkerMetrics:
    """The metrics of one worker serving ``model``, in a registry of their own."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = CollectorRegistry()
        self._stats = EngineStats({}, {}, 0.0, 0, 0, 0)
        r, labels = self.registry, ("model", "tier")
        self.queue_time = Histogram(name("request_queue_time_seconds"),
                                    "From the gateway accepting a request to a worker starting it (JetStream queue).",
                                    labels, buckets=LATENCY_BUCKETS, registry=r)
        self.prompt_tokens = Counter(name("prompt_tokens"), "Prompt tokens of the requests started.", labels,
                                     registry=r)
        self.generation_tokens = Counter(name("generation_tokens"), "Tokens generated.", labels, registry=r)
        self.request_success = Counter(name("request_success"), "Requests finished, by finish reason.",
                                       (*labels, "finished_reason"), registry=r)
        self.dismissed_tokens = Counter(name("worker_dismissed_tokens"),
                                        "Prompt and generated tokens of runs a gateway dismissed, billed to no one: "
                                        "a hedge's loser, or a run taken for dead that was not.", labels, registry=r)
        self.gc_pauses = pause_histogram(r)
        self.step_time = Histogram(name("engine_step_seconds"), "Time inside one engine step.", ("model",),
                                   buckets=TOKEN_INTERVAL_BUCKETS, registry=r)
        self.batch_size = Histogram(name("engine_batch_size"), "Sequences run in one engine step.", ("model",),
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.safety_output = Counter(name("safety_output_verdicts"),
                                     "Choices flagged by the output safety filter (workers/serving/output_filter.py), "
                                     "by category and action: blocked (halted, finish_reason content_filter) or "
                                     "logged.", (*labels, "category", "action"), registry=r)
        r.register(_EngineCollector(self))
        # What the worker holds per tenant (shared/tenant_state.py): its intake and stream replays watch it.
        self.tenant_state = TenantStateCollector()
        r.register(self.tenant_state)

    # -- observations (event loop) -------------------------------------------------------------------------
    def started(self, tier: str, queue_s: float, prompt_tokens: int) -> None:
        self.queue_time.labels(self.model, tier).observe(max(0.0, queue_s))
        self.prompt_tokens.labels(self.model, tier).inc(prompt_tokens)

    def generated(self, tokens_by_tier: dict[str, int]) -> None:
        for tier, n in tokens_by_tier.items():
            self.generation_tokens.labels(self.model, tier).inc(n)

    def finished(self, tier: str, finish_reason: str) -> None:
        self.request_success.labels(self.model, tier, finish_reason).inc()

    def dismissed(self, tier: str, prompt_tokens: int, completion_tokens: int) -> None:
        self.dismissed_tokens.labels(self.model, tier).inc(prompt_tokens + completion_tokens)

    def safety_flagged(self, events) -> None:
        """Count and log the output filter's verdicts of a step (``SafetyEvent``s): ids and category, never text."""
        for e in events:
            self.safety_output.labels(self.model, e.tier, e.category, e.action).inc()
            log.warning("request %s choice %d: output flagged (%s), %s", e.request_id, e.index, e.category, e.action)

    def stepped(self, step_s: float, stats: EngineStats | None) -> None:
        self.step_time.labels(self.model).observe(step_s)
        if stats is not None:
            if stats.batch_size:
                self.batch_size.labels(self.model).observe(stats.batch_size)
            self._stats = stats  # one reference swap: a scrape reads either snapshot whole


class _EngineCollector:
    """Gauges and counters read from the last ``EngineStats`` at scrape time."""

    def __init__(self, metrics: WorkerMetrics) -> None:
        self._metrics = metrics

    def collect(self):
        m, stats = self._metrics, self._metrics._stats
        running = GaugeMetricFamily(name("num_requests_running"), "Requests running in the engine (holding KV).",
                                    labels=("model", "tier"))
        waiting = GaugeMetricFamily(name("num_requests_waiting"),
                                    "Requests queued inside the engine: new, or preempted for memory.",
                                    labels=("model", "tier"))
        for tier in TIER_NAMES:
            running.add_metric((m.model, tier), stats.running.get(tier, 0))
            waiting.add_metric((m.model, tier), stats.waiting.get(tier, 0))
        yield running
        yield waiting
        yield _single(GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                      m.model, stats.kv_cache_usage)
        yield _single(CounterMetricFamily, "prefix_cache_queries",
                      "Prompt tokens looked up in the prefix cache.", m.model, stats.prefix_cache_queries)
        yield _single(CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", m.model,
                      stats.prefix_cache_hits)
        yield _single(CounterMetricFamily, "num_preemptions", "Sequences preempted for KV cache memory.", m.model,
                      stats.num_preemptions)
        yield _single(CounterMetricFamily, "num_pauses",
                      "Running sequences paused for a waiting tenant of their tier, their KV kept.", m.model,
                      stats.num_pauses)
        yield _single(CounterMetricFamily, "spec_decode_num_draft_tokens",
                      "Draft tokens computed by speculative decoding.", m.model, stats.num_draft_tokens)
        yield _single(CounterMetricFamily, "spec_decode_num_accepted_tokens",
                      "Draft tokens the model agreed with (kept).", m.model, stats.num_accepted_draft_tokens)
        yield _single(CounterMetricFamily, "spec_decode_steps_without_drafts",
                      "Decode steps run without drafts, as their batch's size was measured faster so.", m.model,
                      stats.num_steps_without_drafts)
        yield from _kv_tiers(m.model, stats)


# The KV tiers below the pool (workers/kv_tiers/): per tier, what it holds and what it did (this worker's counts).
_KV_TIER_METRICS = [
    (GaugeMetricFamily, "kv_tier_capacity_bytes", "capacity_bytes", "Bytes a KV tier may hold."),
    (GaugeMetricFamily, "kv_tier_used_bytes", "used_bytes", "Bytes a KV tier holds (every worker's blocks)."),
    (GaugeMetricFamily, "kv_tier_blocks", "blocks", "KV blocks a tier holds."),
    (CounterMetricFamily, "kv_tier_hits", "hits", "Blocks read back from a KV tier into the pool."),
    (CounterMetricFamily, "kv_tier_misses", "misses", "Blocks looked up in a KV tier and not there."),
    (CounterMetricFamily, "kv_tier_stores", "stores", "Blocks written to a KV tier."),
    (CounterMetricFamily, "kv_tier_evictions", "evictions", "Blocks a KV tier evicted for room (the host tier "
                                                            "demotes them to the disk tier when there is one)."),
    (CounterMetricFamily, "kv_tier_corrupt_blocks", "corrupt", "Blocks that failed their checksum or identity on "
                                                               "read: removed and recomputed, never served."),
    (CounterMetricFamily, "kv_tier_write_errors", "write_errors", "Writes the tier's filesystem refused (full, "
                                                                  "gone): the block is only not kept."),
    (CounterMetricFamily, "kv_tier_dropped_stores", "dropped", "Blocks not written because the tier's writer was "
                                                               "too far behind."),
]


# Other nodes' tiers (``kv_tier="remote"``) have no size here, and are only read: blocks fetched (hits), blocks
# computed because fetching them would have been slower (misses), blocks that arrived damaged (corrupt).
_REMOTE_FIELDS = frozenset({"hits", "misses", "corrupt"})


def _kv_tiers(model: str, stats: EngineStats):
    if not stats.kv_tiers:
        return
    for family, metric, field, documentation in _KV_TIER_METRICS:
        out = family(name(metric), documentation, labels=("model", "kv_tier"))
        for tier in stats.kv_tiers:
            if tier.tier != "remote" or field in _REMOTE_FIELDS:
                out.add_metric((model, tier.tier), getattr(tier, field))
        yield out


def _single(family, metric: str, documentation: str, model: str, value: float):
    out = family(name(metric), documentation, labels=("model",))
    out.add_metric((model,), value)
    return out
