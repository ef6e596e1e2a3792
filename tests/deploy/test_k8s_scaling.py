"""The KEDA ScaledObject: rendered from the project's own subject names, committed as rendered, and wired to the
worker Deployment and the NATS chart it reads."""

from __future__ import annotations

import subprocess
import sys

import yaml

from switchyard.deploy import k8s_scaling
from switchyard.shared.subjects import request_consumer, request_stream
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


def test_one_trigger_per_tier_on_that_tiers_stream_and_consumer():
    (scaled,) = load_yaml_documents(COMMITTED)
    model = scaled["metadata"]["annotations"]["switchyard.dev/model"]
    triggers = {t["name"]: t for t in scaled["spec"]["triggers"]}
    assert list(triggers) == list(TIER_NAMES)
    for tier, trigger in triggers.items():
        assert trigger["type"] == "nats-jetstream"
        assert trigger["metadata"]["stream"] == request_stream(tier)
        assert trigger["metadata"]["consumer"] == request_consumer(model, tier)


def test_higher_tiers_ask_for_workers_sooner():
    (scaled,) = load_yaml_documents(COMMITTED)
    lag = {t["name"]: int(t["metadata"]["lagThreshold"]) for t in scaled["spec"]["triggers"]}
    ordered = [lag[t.name] for t in tiers_by_priority()]
    assert ordered == sorted(ordered) and len(set(ordered)) == len(ordered), lag


def test_it_scales_the_workers_of_its_model_on_the_nats_chart_it_reads():
    (scaled,) = load_yaml_documents(COMMITTED)
    model = scaled["metadata"]["annotations"]["switchyard.dev/model"]
    (deployment,) = load_yaml_documents(K8S / "base" / "worker-deployment.yaml")
    assert scaled["spec"]["scaleTargetRef"]["name"] == deployment["metadata"]["name"]
    worker = next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "worker")
    assert env_value(worker, "SWITCHYARD_WORKER__MODEL") == model

    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    for trigger in scaled["spec"]["triggers"]:
        meta = trigger["metadata"]
        host, _, port = meta["natsServerMonitoringEndpoint"].partition(":")
        # The chart's headless Service (release `nats`), which carries the monitoring port: KEDA reaches each
        # server as <pod>.<that host> to find the consumer's leader.
        assert host.startswith("nats-headless.") and int(port) == values["config"]["monitor"]["port"]
        assert meta["account"] in values["config"]["merge"]["accounts"]


def test_any_model_name_renders_a_valid_object():
    text = k8s_scaling.render("Org/Llama-3.1 8B", lag_thresholds={"batch": 5000}, min_replicas=0, max_replicas=3)
    scaled = yaml.safe_load(text)
    validate_object(scaled)
    name = scaled["metadata"]["name"]
    assert name == "switchyard-worker-org-llama-3-1-8b" and scaled["spec"]["scaleTargetRef"]["name"] == name
    consumers = {t["name"]: t["metadata"]["consumer"] for t in scaled["spec"]["triggers"]}
    assert consumers == {tier: request_consumer("Org/Llama-3.1 8B", tier) for tier in TIER_NAMES}
    assert scaled["spec"]["triggers"][-1]["metadata"]["lagThreshold"] == "5000"
    assert scaled["spec"]["minReplicaCount"] == 0 and scaled["spec"]["maxReplicaCount"] == 3
