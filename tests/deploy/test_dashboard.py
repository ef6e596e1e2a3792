"""The Grafana dashboard asks only for what the code exports: every metric an expression names is a sample of the
gateway's or a worker's registry, and every label it matches on is one of that metric's labels."""

from __future__ import annotations

import copy
import json
import re

import pytest
from prometheus_client.metrics import MetricWrapperBase

from switchyard.gateway.metrics import GatewayMetrics
from switchyard.shared.tiers import TIER_NAMES
from switchyard.workers.kv_tiers import KVTierStats
from switchyard.workers.service.metrics import WorkerMetrics
from switchyard.workers.serving.stats import EngineStats
from tests.deploy.manifest_checks import DEPLOY

DASHBOARD = DEPLOY / "grafana" / "dashboards" / "switchyard.json"
METRIC = re.compile(r"switchyard:[a-zA-Z0-9_:]+")
SELECTOR = re.compile(r"(switchyard:[a-zA-Z0-9_:]+)\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(?:=~|!~|!=|=)")
# Labels Prometheus itself attaches to every scraped sample (and prometheus-operator's target labels).
TARGET_LABELS = {"instance", "job", "namespace", "pod", "service", "container", "endpoint"}
# What the dashboard must show (issue 14): a family missing from every query fails here.
REQUIRED = {"time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "queue_depth",
            "queue_oldest_age_seconds", "kv_cache_usage_perc", "generation_tokens_total", "request_errors_total",
            "billing_lag_seconds", "billing_lag_records", "num_requests_running", "num_requests_waiting",
            "num_preemptions_total", "batch_lines", "event_loop_lag_seconds_bucket", "admission_seconds_bucket",
            "gc_pause_seconds_bucket", "kv_tier_hits_total", "kv_tier_used_bytes", "kv_tier_capacity_bytes"}


def _observe_all(metrics) -> None:
    """One observation in each labelled metric: an unobserved labelled histogram or counter exports no samples,
    and the samples are what a query names (``_bucket``, ``_total``, ...)."""
    for metric in vars(metrics).values():
        if isinstance(metric, MetricWrapperBase):
            child = metric.labels(*["x"] * len(metric._labelnames)) if metric._labelnames else metric
            record = {"histogram": "observe", "counter": "inc", "gauge": "set"}[metric._type]
            getattr(child, record)(1)


def exported() -> dict[str, set[str]]:
    """Sample name -> its label names, over the gateway's and a worker's registries."""
    gateway, worker = GatewayMetrics(), WorkerMetrics("m")
    _observe_all(gateway)
    _observe_all(worker)
    # The KV tiers' families come from the engine's stats, one sample per tier: a worker with a host tier.
    worker.stepped(0.01, EngineStats({}, {}, 0.0, 0, 0, 0, kv_tiers=[KVTierStats("host", 1, 0, 0, 0, 0, 0, 0, 0, 0)]))
    samples: dict[str, set[str]] = {}
    for registry in (gateway.registry, worker.registry):
        for family in registry.collect():
            for sample in family.samples:
                samples.setdefault(sample.name, set()).update(sample.labels)
    return samples


def _exprs(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs


def unknown_metrics(dashboard: dict, samples: dict[str, set[str]]) -> list[str]:
    """What the dashboard's queries name that the code does not export: metrics, or labels of a metric."""
    problems = []
    for expr in _exprs(dashboard):
        problems += [f"{name} in {expr}" for name in METRIC.findall(expr) if name not in samples]
        for name, matchers in SELECTOR.findall(expr):
            labels = samples.get(name, set()) | TARGET_LABELS
            problems += [f"label {label} of {name}" for label in MATCHER.findall(matchers) if label not in labels]
    return problems


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def samples() -> dict[str, set[str]]:
    return exported()


def test_every_query_names_exported_metrics_and_labels(dashboard, samples):
    assert unknown_metrics(dashboard, samples) == []


def test_the_dashboard_shows_what_operators_need(dashboard):
    used = {name.removeprefix("switchyard:") for expr in _exprs(dashboard) for name in METRIC.findall(expr)}
    assert REQUIRED <= used, REQUIRED - used
    quantiles = [e for e in _exprs(dashboard) if "histogram_quantile" in e]
    for family in ("time_to_first_token_seconds", "inter_token_latency_seconds"):
        for q in ("0.5", "0.95"):
            assert any(f"histogram_quantile({q}," in e and family in e and "tier" in e for e in quantiles), (family, q)
    errors = " ".join(e for e in _exprs(dashboard) if "request_errors_total" in e)
    assert 'status="429"' in errors and 'status="503"' in errors and "reason" in errors


def test_every_panel_has_a_prometheus_datasource_and_a_place(dashboard):
    assert dashboard["uid"] and dashboard["title"]
    cells = set()
    for panel in dashboard["panels"]:
        pos = panel["gridPos"]
        assert pos["x"] + pos["w"] <= 24, panel["title"]
        covered = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not covered & cells, f"{panel['title']} overlaps another panel"
        cells |= covered
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["type"] == "prometheus", panel["title"]
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            assert target["expr"] and target["datasource"]["type"] == "prometheus", panel["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


def test_tier_variable_lists_the_tiers(dashboard):
    (tier,) = [v for v in dashboard["templating"]["list"] if v["name"] == "tier"]
    assert tier["query"].split(",") == list(TIER_NAMES)


def test_the_check_catches_a_misspelled_metric_or_label(dashboard, samples):
    broken = copy.deepcopy(dashboard)
    target = next(t for p in broken["panels"] for t in p.get("targets", []) if "queue_depth" in t["expr"])
    target["expr"] = target["expr"].replace("queue_depth", "queue_dept")
    assert any("switchyard:queue_dept " in p for p in unknown_metrics(broken, samples))
    broken = copy.deepcopy(dashboard)
    target = next(t for p in broken["panels"] for t in p.get("targets", []) if 'status="429"' in t["expr"])
    target["expr"] = target["expr"].replace('status="429"', 'code="429"')
    assert any("label code" in p for p in unknown_metrics(broken, samples))
