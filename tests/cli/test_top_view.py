"""``switchyard top``'s arithmetic on fabricated scrapes: windows, sums across processes, histogram quantiles."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from switchyard.cli.top_view import histogram_quantile, merge, parse, tier_rows, window

TTFT = "switchyard:time_to_first_token_seconds"


def scrape(ttfts: list[float], tokens: int, refusals: int, running: int) -> dict:
    """A gateway's and a worker's exposition, as real ones print them, merged."""
    registry = CollectorRegistry()
    hist = Histogram(TTFT, "ttft", ("model", "tier"), buckets=(0.1, 0.5, 1.0, 5.0), registry=registry)
    for t in ttfts:
        hist.labels("m", "pro").observe(t)
    Counter("switchyard:request_errors", "errors", ("model", "tier", "status", "reason"),
            registry=registry).labels("m", "pro", "429", "rate_limit_exceeded").inc(refusals)
    Counter("switchyard:generation_tokens", "tokens", ("model", "tier"), registry=registry).labels("m", "pro").inc(
        tokens)
    samples = parse(generate_latest(registry).decode())
    samples[("switchyard:num_requests_running", frozenset({("model", "m"), ("tier", "pro")}))] = running
    return samples


def test_quantile_interpolates_inside_its_bucket_like_prometheus():
    samples = scrape([0.05] * 50 + [0.3] * 50, 0, 0, 0)
    # rank 95 of 100 falls in (0.1, 0.5] which holds ranks 51..100: 0.1 + 0.4 * 45/50
    assert histogram_quantile(0.95, samples, TTFT, model="m", tier="pro") == pytest.approx(0.46)
    assert histogram_quantile(0.5, samples, TTFT, model="m", tier="pro") == pytest.approx(0.1)
    assert histogram_quantile(0.95, samples, TTFT, model="m", tier="free") is None
    beyond = scrape([9.0] * 10, 0, 0, 0)  # all past the last finite bound: that bound, as Prometheus says
    assert histogram_quantile(0.95, beyond, TTFT, model="m") == 5.0


def test_rows_count_only_the_window_and_add_up_processes():
    first = scrape([0.05] * 100, tokens=1000, refusals=7, running=3)
    # Two gateways and two workers: a later scrape of each, summed; the window holds only what came since.
    later = merge([scrape([0.05] * 100 + [2.0] * 10, 1200, 9, 3), scrape([], 0, 0, 2)])
    rows = tier_rows({("m", "pro"): (12, 4.25), ("m", "free"): (0, None)}, later, window(first, later),
                     window(first, later), window_s=2.0)
    by_tier = {r["tier"]: r for r in rows}
    pro = by_tier["pro"]
    assert (pro["queued"], pro["oldest_wait"], pro["running"]) == (12, "4.2s", 5)
    assert pro["ttft_p95"] == "4.8s"  # only the 10 new first tokens, all in (1, 5]: 1 + 4 * 9.5/10
    assert (pro["tokens_per_s"], pro["429s"], pro["503s"]) == ("100.0", 2, 0)
    free = by_tier["free"]
    assert (free["queued"], free["oldest_wait"], free["ttft_p95"], free["429s"]) == (0, None, None, 0)


def test_a_restarted_process_counts_from_zero():
    before = scrape([], tokens=5000, refusals=0, running=0)
    after = scrape([], tokens=300, refusals=0, running=0)  # its worker restarted
    assert window(before, after)[("switchyard:generation_tokens_total",
                                  frozenset({("model", "m"), ("tier", "pro")}))] == 300
