"""The KEDA ScaledObject: rendered from the project's own metric names, committed as rendered, and wired to the
worker Deployment and the queue gauge the gateways export."""

from __future__ import annotations

import subprocess
import sys

import yaml

from switchyard.deploy import k8s_scaling
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.shared.metrics import exported_names
from switchyard.shared.tiers import TIER_NAMES, tiers_by_priority
from tests.deploy.manifest_checks import K8S, ROOT, env_value, load_yaml_documents, validate_object

COMMITTED = K8S / "base" / "worker-scaledobject.yaml"
RENDER = "python -m switchyard.deploy.k8s_scaling --model smollm2 > deploy/k8s/base/worker-scaledobject.yaml"


def test_committed_scaled_object_is_the_renderers_output():
    # A renamed stream, consumer or tier changes the rendering: render the file again (command above).
    assert COMMITTED.read_text() == k8s_scaling.render("smollm2"), f"stale: run `{RENDER}`"


def test_the_module_runs_as_a_command():
    proc = subprocess.run([sys.executable, "-m", "switchyard.deploy.k8s_scaling", "--model", "smollm2"],
                          capture_output=True, text=True, cwd=ROOT, timeout=60, check=True)
    assert proc.stdout == COMMITTED.read_text()


def test_one_trigger_per_tier_on_that_tiers_queue_gauge():
    (scaled,) = load_yaml_documents(COMMITTED)
    model = scaled["metadata"]["annotations"]["switchyard.dev/model"]
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    assert list(triggers) == list(TIER_NAMES)
    gateway = GatewayMetrics()
    gateway.queue_depth.labels(model, "pro").set(1)
    for tier, trigger in triggers.items():
        assert trigger["type"] == "prometheus"
        query = trigger["metadata"]["query"]
        assert query == f'max(switchyard:queue_depth{{model="{model}",tier="{tier}"}})'
        assert "switchyard:queue_depth" in exported_names(gateway.registry)


def test_higher_tiers_ask_for_workers_sooner():
    (scaled,) = load_yaml_documents(COMMITTED)
    lag = {t["name"]: int(t["metadata"]["threshold"]) for t in scaled["spec"]["triggers"]}
    ordered = [lag[t.name] for t in tiers_by_priority()]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered), lag


def test_it_scales_the_workers_of_its_model():
    (scaled,) = load_yaml_documents(COMMITTED)
    model = scaled["metadata"]["annotations"]["switchyard.dev/model"]
    (deployment,) = load_yaml_documents(K8S / "base" / "worker-deployment.yaml")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    worker = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
    assert env_value(worker, "SWITCHYARD_WORKER__MODEL") == model


def test_any_model_name_renders_a_valid_object():
    text = k8s_scaling.render("Org/Llama-3.1 8B", lag_thresholds={"batch": 5000}, min_replicas=0, max_replicas=3)
    scaled = yaml.safe_load(text)
    validate_object(scaled)
    name = scaled["metadata"]["name"]
    assert name == "switchyard-worker-org-llama-3-1-8b" and scaled["spec"]["scaleTargetRef"]["name"] == name
    queries = {t["name"]: t["metadata"]["query"] for t in scaled["spec"]["triggers"]}
    assert queries == {tier: k8s_scaling.queue_query("Org/Llama-3.1 8B", tier) for tier in TIER_NAMES}
    assert scaled["spec"]["triggers"][-1]["metadata"]["threshold"] == "5000"
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["maxReplicaCount"] == 3
