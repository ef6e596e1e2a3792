"""KEDA ScaledObjects for worker Deployments: one per model, one ``nats-jetstream`` trigger per tier.

A worker pulls only what it can admit now, so a tier's backlog is its durable consumer's lag in JetStream
(``num_pending + num_ack_pending``, read by KEDA from the NATS servers' ``/jsz``): the same queue ops see in
``switchyard top``. Stream and consumer names come from ``shared/subjects.py``, never typed by hand; a renamed
subject changes this output, and the test that compares it with the committed manifest fails until it is rendered
again:

    python -m switchyard.deploy.k8s_scaling --model smollm2 > deploy/k8s/base/worker-scaledobject.yaml

KEDA hands the HPA one metric per trigger and the HPA follows the largest wish, within min..max:

    replicas = max over tiers of ceil(lag(tier) / lagThreshold(tier))

so a lower threshold buys a tier capacity sooner: a few waiting enterprise requests ask for another worker, batch
asks only once its queue is deep (it may wait hours by design, and ``--max-replicas`` caps what it can ask for).
"""

from __future__ import annotations

import argparse
import re
import shlex
import sys

import yaml

from switchyard.shared.subjects import model_token, request_consumer, request_stream
from switchyard.shared.tiers import TIER_NAMES

# Requests waiting per worker before another is asked for. A worker already runs max_num_seqs (32) at once and
# pulls only what fits, so any lag means every worker is full: the thresholds say how long each tier may queue.
LAG_THRESHOLDS = {"enterprise": 4, "pro": 8, "free": 32, "batch": 1024}
# Used only with --min-replicas 0: the lag that wakes the first worker. Batch lines do not start a GPU one by one.
ACTIVATION_THRESHOLDS = {"enterprise": 0, "pro": 0, "free": 0, "batch": 64}
MONITORING_ENDPOINT = "nats-headless.nats.svc.cluster.local:8222"  # headless: KEDA finds each consumer's leader
NATS_ACCOUNT = "SWITCHYARD"  # deploy/k8s/nats-values.yaml


def default_deployment(model: str) -> str:
    """The worker Deployment's name for ``model``: a DNS label (lower case, digits, '-')."""
    return "switchyard-worker-" + re.sub(r"[^a-z0-9-]+", "-", model_token(model).lower()).strip("-")


def scaled_object(model: str, deployment: str, monitoring_endpoint: str = MONITORING_ENDPOINT,
                  lag_thresholds: dict[str, int] | None = None, activation_thresholds: dict[str, int] | None = None,
                  min_replicas: int = 1, max_replicas: int = 8, account: str = NATS_ACCOUNT) -> dict:
    """The ScaledObject for ``model``'s workers (``deployment``), as a dict; thresholds default per tier."""
    lag = {**LAG_THRESHOLDS, **(lag_thresholds or {})}
    activation = {**ACTIVATION_THRESHOLDS, **(activation_thresholds or {})}
    triggers = [{
        "type": "nats-jetstream",
        "name": tier,
        # KEDA's trigger metadata is a map of strings: numbers are quoted.
        "metadata": {
            "natsServerMonitoringEndpoint": monitoring_endpoint,
            "account": account,
            "stream": request_stream(tier),
            "consumer": request_consumer(model, tier),
            "lagThreshold": str(lag[tier]),
            "activationLagThreshold": str(activation[tier]),
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
            # NATS monitoring unreachable: keep what runs (never shrink on missing data), at least min_replicas.
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
    p.add_argument("--monitoring-endpoint", default=MONITORING_ENDPOINT, help="NATS monitoring host:port")
    p.add_argument("--account", default=NATS_ACCOUNT, help="NATS account holding the request streams")
    p.add_argument("--lag", type=_tier_values, default={}, help="per tier lagThreshold, e.g. enterprise=2,free=64")
    p.add_argument("--activation", type=_tier_values, default={}, help="per tier activationLagThreshold")
    p.add_argument("--min-replicas", type=int, default=1)
    p.add_argument("--max-replicas", type=int, default=8)
    args = p.parse_args(argv)
    command = sys.argv[1:] if argv is None else argv
    print(render(args.model, args.deployment, command, monitoring_endpoint=args.monitoring_endpoint,
                 account=args.account, lag_thresholds=args.lag, activation_thresholds=args.activation,
                 min_replicas=args.min_replicas, max_replicas=args.max_replicas), end="")


if __name__ == "__main__":
    main()
