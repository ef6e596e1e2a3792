"""Prometheus conventions shared by the gateway's and the workers' metrics: the name prefix, the histogram
buckets, and the exposition.

Names and meanings follow vLLM's where they match (``vllm:time_to_first_token_seconds`` is
``switchyard:time_to_first_token_seconds`` here), so dashboards and alerts written for vLLM carry over. Labels
are bounded: a model label only ever holds a served model's name, a tier label one of the tiers, a reason one of
the gateway's error codes; never a request, tenant or key id.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "switchyard:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Seconds. First tokens include the JetStream queue, so the tail reaches minutes under overload.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 1.5, 2.5, 5.0, 7.5, 10.0,
                   20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
TOKEN_INTERVAL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
                          1.0, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 300.0,
                   600.0, 1800.0, 3600.0)
# A loop late by more than a few milliseconds is already adding to every client's first token.
LOOP_LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
GC_PAUSE_BUCKETS = (0.0001, 0.00025, 0.0005) + LOOP_LAG_BUCKETS  # a young collection takes well under 1 ms
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512)


def name(metric: str) -> str:
    return PREFIX + metric


def render(registry: CollectorRegistry) -> bytes:
    """The registry in the Prometheus text format."""
    return generate_latest(registry)


def exported_names(registry: CollectorRegistry) -> set[str]:
    """Every sample name the registry exports (``_total``, ``_bucket``, ``_sum``, ``_count`` included): what a
    dashboard query may name."""
    names: set[str] = set()
    for family in registry.collect():
        names.update(sample.name for sample in family.samples)
        names.add(family.name)
    return names
