"""What ``switchyard top`` shows, computed from Prometheus scrapes: pure functions, no I/O.

Every figure but the queue is a rate over the refresh window (the difference of two scrapes), the way a dashboard
shows it, so an operator changing a tier's limits sees the effect within a refresh rather than diluted by history.
Scrapes of several gateways (or workers) are summed sample by sample: counters and histogram buckets add up across
processes, and so do the running-request gauges.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from prometheus_client.parser import text_string_to_metric_families

from switchyard.shared.metrics import name

Labels = frozenset[tuple[str, str]]
Samples = dict[tuple[str, Labels], float]

COLUMNS = ("model", "tier", "queued", "oldest_wait", "running", "ttft_p95", "tokens_per_s", "429s", "503s")


def parse(text: str) -> Samples:
    """A scrape's text as (sample name, labels) -> value."""
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def merge(scrapes: Iterable[Samples]) -> Samples:
    total: Samples = {}
    for samples in scrapes:
        for key, value in samples.items():
            total[key] = total.get(key, 0.0) + value
    return total


def window(before: Samples, after: Samples) -> Samples:
    """What the cumulative samples gained between two scrapes. A sample that fell (its process restarted and
    counts from zero again) counts what it has now."""
    return {key: value - before.get(key, 0.0) if value >= before.get(key, 0.0) else value
            for key, value in after.items()}


def total(samples: Samples, metric: str, **labels: str) -> float:
    """The sum of ``metric``'s samples whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, got), v in samples.items() if n == metric and want <= got)


def histogram_quantile(q: float, samples: Samples, metric: str, **labels: str) -> float | None:
    """The ``q`` quantile of histogram ``metric`` (its ``_bucket`` samples matching ``labels``, summed), with
    Prometheus' linear interpolation inside a bucket; None when it holds no observation."""
    buckets: dict[float, float] = {}
    for (n, got), v in samples.items():
        if n == metric + "_bucket" and set(labels.items()) <= got:
            le = float(dict(got)["le"])
            buckets[le] = buckets.get(le, 0.0) + v
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower, below = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank:
            if math.isinf(upper):  # beyond the last finite bound: say the bound, as Prometheus does
                return lower
            return lower + (upper - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = upper, count
    return lower


def _seconds(value: float | None) -> str | None:
    if value is None:
        return None
    return f"{value * 1000:.0f}ms" if value < 1 else f"{value:.1f}s"


def tier_rows(queues: dict[tuple[str, str], tuple[int, float | None]], workers: Samples, gateway_window: Samples,
              worker_window: Samples, window_s: float) -> list[dict]:
    """One row per (model, tier) in ``queues`` (its depth and oldest wait, read from JetStream): the requests
    running on the workers now, and over the window the gateways' TTFT p95, the workers' generated tokens per
    second, and the gateways' 429 and 503 answers."""
    rows = []
    for (model, tier), (depth, oldest_s) in queues.items():  # in the caller's order: by model, tiers by priority
        labels = {"model": model, "tier": tier}
        tokens = total(worker_window, name("generation_tokens_total"), **labels)
        rows.append({
            "model": model,
            "tier": tier,
            "queued": depth,
            "oldest_wait": _seconds(oldest_s),
            "running": int(total(workers, name("num_requests_running"), **labels)),
            "ttft_p95": _seconds(histogram_quantile(0.95, gateway_window, name("time_to_first_token_seconds"),
                                                    **labels)),
            "tokens_per_s": f"{tokens / window_s:.1f}" if window_s > 0 else None,
            "429s": int(total(gateway_window, name("request_errors_total"), status="429", **labels)),
            "503s": int(total(gateway_window, name("request_errors_total"), status="503", **labels)),
        })
    return rows
