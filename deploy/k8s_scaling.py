"""KEDA ScaledObjects for worker Deployments: one per model, one Prometheus trigger per tier.

A worker pulls only what it can admit now, so a tier's backlog is what waits in JetStream: every tenant's queue of
the model in that tier (a queue per tenant, so that tenants share the tier fairly: scheduler/tenant_share.py).
The gateways read it from JetStream every few seconds into ``switchyard:queue_depth{model, tier}`` (the same
number ``switchyard top`` and ``tiers show`` print), and KEDA reads that gauge from Prometheus. (KEDA's
``nats-jetstream`` scaler reads one consumer's lag, and a tier has a consumer per tenant.) Metric and label names
come from the code (gateway/metrics.py), never typed by hand; a test compares this output with the committed
manifest:

    python -m switchyard.deploy.k8s_scaling --model smollm2 > deploy/k8s/base/worker-scaledobject.yaml

KEDA hands the HPA one metric per trigger and the HPA follows the largest wish, within min..max:

    replicas = max over tiers of ceil(queued(tier) / threshold(tier))

so a lower threshold buys a tier capacity sooner: a few waiting enterprise requests ask for another worker, batch
asks only once its queue is deep (it may wait hours by design, and ``--max-replicas`` caps what it can ask for).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys

import yaml

from switchyard.shared.metrics import name as metric_name
from switchyard.shared.subjects import model_token
from switchyard.shared.tiers import TIER_NAMES, TIERS

# Requests waiting per worker before another is asked for, and (only with --min-replicas 0) the queue that wakes
# the first worker: each tier's own (shared/tiers.py).
LAG_THRESHOLDS = {t.name: t.scale_threshold for t in TIERS}
ACTIVATION_THRESHOLDS = {t.name: t.scale_activation for t in TIERS}
# prometheus-operator's Service for the Prometheus it runs (the ServiceMonitor/PodMonitor feed it).
PROMETHEUS_ADDRESS = "http://prometheus-operated.monitoring.svc.cluster.local:9090"
QUEUE_METRIC = metric_name("queue_depth")


def queue_query(model: str, tier: str) -> str:
    """The tier's queue of ``model``: every gateway exports the same reading, so the largest is it."""
    escaped = model.replace("\\", "\\\\").replace('"', '\\"')
    return f'max({QUEUE_METRIC}{{model="{escaped}",tier="{tier}"}})'


def default_deployment(model: str) -> str:
    """The worker Deployment's name for ``model``: a DNS label (lower case, digits, '-')."""
    return "switchyard-worker-" + re.sub(r"[^a-z0-9-]+", "-", model_token(model).lower()).strip("-")


def scaled_object(model: str, deployment: str, prometheus_address: str = PROMETHEUS_ADDRESS,
                  lag_thresholds: dict[str, int] | None = None, activation_thresholds: dict[str, int] | None = None,
                  min_replicas: int = 1, max_replicas: int = 8) -> dict:
    """The ScaledObject for ``model``'s workers (``deployment``), as a dict; thresholds default per tier."""
    lag = {**LAG_THRESHOLDS, **(lag_thresholds or {})}
    activation = {**ACTIVATION_THRESHOLDS, **(activation_thresholds or {})}
    triggers = [{
        "type": "prometheus",
        "name": tier,
        # KEDA's trigger metadata is a map of strings: numbers are quoted.
        "metadata": {
            "serverAddress": prometheus_address,
            "query": queue_query(model, tier),
            "threshold": str(lag[tier]),
            "activationThreshold": str(activation[tier]),
            "ignoreNullValues": "true",  # no gateway has read the queue yet: nothing queued
        },
    } for tier in TIER_NAMES]
    return {
        "apiVersion": "keda.sh/v1alpha1",
        "kind": "ScaledObject",
        "metadata": {"name": deployment, "labels": {"app.kubernetes.io/name": "switchyard-worker"},
                     "annotations": {"switchyard.dev/model": model}},
        "spec": {
            "scaleTargetRef": {"name": deployment},
            "minReplicaCount": min_replicas,
            "maxReplicaCount": max_replicas,
            "pollingInterval": 10,
            "cooldownPeriod": 300,
            # Prometheus unreachable: keep what runs (never shrink on missing data), at least min_replicas.
            "fallback": {"failureThreshold": 3, "replicas": max(min_replicas, 1),
                         "behavior": "currentReplicasIfHigher"},
            "advanced": {"horizontalPodAutoscalerConfig": {"behavior": {
                # A new worker costs a model load (and a GPU): add fast, remove one at a time after 5 quiet minutes.
                "scaleUp": {"stabilizationWindowSeconds": 0,
                            "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": 300,
                              "policies": [{"type": "Pods", "value": 1, "periodSeconds": 120}]},
            }}},
            "triggers": triggers,
        },
    }


def render(model: str, deployment: str | None = None, command: list[str] | None = None, **options) -> str:
    """``scaled_object`` as YAML, headed by the command that renders it again (``command``: its arguments)."""
    argv = ["python", "-m", "switchyard.deploy.k8s_scaling", *(command or ["--model", model])]
    header = f"# Rendered by `{shlex.join(argv)}`: do not edit, render again.\n"
    body = scaled_object(model, deployment or default_deployment(model), **options)
    return header + yaml.safe_dump(body, sort_keys=False)


def _tier_values(text: str) -> dict[str, int]:
    """``enterprise=2,batch=500`` -> {"enterprise": 2, "batch": 500}."""
    pairs = dict(item.split("=", 1) for item in text.split(",") if item)
    unknown = set(pairs) - set(TIER_NAMES)
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown tier(s) {sorted(unknown)}; known: {', '.join(TIER_NAMES)}")
    return {tier: int(value) for tier, value in pairs.items()}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m switchyard.deploy.k8s_scaling", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="served model name, as workers register it")
    p.add_argument("--deployment", help="worker Deployment to scale (default: switchyard-worker-<model>)")
    p.add_argument("--prometheus", default=PROMETHEUS_ADDRESS, help="the Prometheus KEDA queries")
    p.add_argument("--lag", type=_tier_values, default={}, help="per tier threshold, e.g. enterprise=2,free=64")
    p.add_argument("--activation", type=_tier_values, default={}, help="per tier activationThreshold")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=8)
    args = p.parse_args(argv)
    command = sys.argv[1:] if argv is None else argv
    print(render(args.model, args.deployment, command, prometheus_address=args.prometheus,
                 lag_thresholds=args.lag, activation_thresholds=args.activation,
                 min_replicas=args.min_replicas, max_replicas=args.max_replicas), end="")


if __name__ == "__main__":
    main()
