"""deploy/k8s: every object valid against the Kubernetes schemas and the CRDs it uses, both overlays rendered as
`kubectl apply -k` would, and the properties the deployment relies on (drains that fit their grace period, probes
on the right ports, non-root read-only containers, settings that exist)."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from switchyard.deploy import k8s_scaling
from switchyard.shared.config import GatewayConfig, SwitchyardConfig, VllmSettings, WorkerConfig
from switchyard.shared.subjects import prefill_queue
from switchyard.workers.vllm_engine import kv_transfer
from switchyard.workers.vllm_engine.args import engine_kwargs
from tests.deploy.manifest_checks import (
    K8S,
    by_kind,
    container_port,
    containers,
    env_value,
    image_has_tag,
    is_setting,
    kubectl,
    kustomize,
    load_yaml_documents,
    pod_spec,
    validate_object,
)

OVERLAYS = ("cpu", "gpu", "gpu-disagg")


def _render(name: str, tmp_path_factory) -> list[dict]:
    """An overlay as `kubectl kustomize` renders it; ``gpu+cnpg`` is the gpu overlay with the CloudNativePG
    component, assembled the way the README tells an operator to."""
    if kubectl() is None:
        pytest.skip("kubectl not installed (pip install -e '.[test]')")
    if name in OVERLAYS:
        return kustomize(K8S / "overlays" / name)
    base, component = name.split("+")
    work = tmp_path_factory.mktemp(name.replace("+", "-"))
    rel = Path(os.path.relpath(K8S, work))  # kustomize refuses absolute paths
    (work / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [str(rel / "overlays" / base)], "components": [str(rel / "components" / component)],
    }))
    return kustomize(work)


@pytest.fixture(scope="module", params=[*OVERLAYS, "gpu+cnpg", "gpu+vllm"])
def rendered(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return request.param, _render(request.param, tmp_path_factory)


@pytest.fixture(scope="module")
def with_cnpg(tmp_path_factory) -> list[dict]:
    return _render("cpu+cnpg", tmp_path_factory)


def _kustomizations() -> list[Path]:
    return sorted((K8S.parent).rglob("kustomization.yaml"))


# -- files ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("path", _kustomizations(), ids=lambda p: str(p.relative_to(K8S.parent)))
def test_every_path_a_kustomization_names_exists(path: Path):
    k = yaml.safe_load(path.read_text())
    names = [*k.get("resources", []), *k.get("components", [])]
    names += [p["path"] for p in k.get("patches", []) if "path" in p]
    names += [f for gen in k.get("configMapGenerator", []) for f in gen.get("files", [])]
    assert names, f"{path} names nothing"
    for name in names:
        target = path.parent / name
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{path}: {name} does not exist"


def _standalone_files() -> list[Path]:
    """Every whole object under deploy/k8s: base resources, the component's Cluster, the Secret template (patches
    are partial objects: they are checked rendered, below)."""
    patches = {(p.parent / q["path"]).resolve() for p in _kustomizations()
               for q in yaml.safe_load(p.read_text()).get("patches", []) if "path" in q}
    skip = {"kustomization.yaml", "nats-values.yaml"}
    return sorted(p for p in K8S.rglob("*.yaml") if p.name not in skip and p.resolve() not in patches)


@pytest.mark.parametrize("path", _standalone_files(), ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_file_is_valid(path: Path):
    for obj in load_yaml_documents(path):
        validate_object(obj)


# -- rendered overlays ------------------------------------------------------------------------------------------
def test_rendered_objects_are_valid(rendered):
    name, objects = rendered
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "Service", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Job", "ScaledObject",
            "ServiceMonitor", "PodMonitor", "PersistentVolumeClaim", "ConfigMap"} <= kinds, name
    for obj in objects:
        validate_object(obj)
        if obj["kind"] != "Namespace":
            assert obj["metadata"].get("namespace") == "switchyard", obj["metadata"]["name"]


def test_containers_run_hardened_and_pinned(rendered):
    name, objects = rendered
    for obj in objects:
        spec = pod_spec(obj)
        if spec is None:
            continue
        where = f"{name}: {obj['kind']}/{obj['metadata']['name']}"
        assert spec["securityContext"]["runAsNonRoot"] is True, where
        assert spec.get("automountServiceAccountToken") is False, where
        for c in containers(spec):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False, where
            assert sc["capabilities"]["drop"] == ["ALL"], where
            # A read-only root needs a writable /tmp (tempfile, uploads) and data dir (caches).
            mounts = {m["mountPath"] for m in c.get("volumeMounts", [])}
            assert {"/tmp", "/var/lib/switchyard"} <= mounts, where
            assert image_has_tag(c["image"]), f"{where}: {c['image']}"
            assert c["resources"]["requests"] and c["resources"]["limits"]["memory"], where
            names = [e["name"] for e in c.get("env", [])]
            assert len(names) == len(set(names)), f"{where}: duplicate env {names}"
            assert all(is_setting(n) for n in names), f"{where}: {[n for n in names if not is_setting(n)]}"


def test_settings_in_config_maps_and_secret_exist(rendered):
    _, objects = rendered
    keys = [k for cm in by_kind(objects, "ConfigMap").values() for k in cm.get("data", {}) if k.startswith("SW")]
    keys += list(yaml.safe_load((K8S / "secret.example.yaml").read_text())["stringData"])
    keys += list(yaml.safe_load((K8S / "secret-migrate.example.yaml").read_text())["stringData"])
    keys += list(yaml.safe_load((K8S / "secret-worker.example.yaml").read_text())["stringData"])
    assert keys and all(is_setting(k) for k in keys), [k for k in keys if not is_setting(k)]


def test_only_the_migrations_hold_the_superusers_database_url(rendered):
    name, objects = rendered
    secrets = {obj["metadata"]["name"]: obj for obj in objects if obj.get("kind") == "Secret"}
    for obj in objects:
        if pod_spec(obj) is None:
            continue
        for c in pod_spec(obj)["containers"]:
            refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in c.get("env", [])
                    if "secretKeyRef" in e.get("valueFrom", {})}
            if obj["metadata"]["name"] == "switchyard-migrate" and "cnpg" in name:  # the operator's owner
                assert "SWITCHYARD_APP_DATABASE_PASSWORD" not in refs  # who cannot make roles
            elif obj["metadata"]["name"] == "switchyard-migrate":
                assert refs["SWITCHYARD_DATABASE_URL"] == refs["SWITCHYARD_APP_DATABASE_PASSWORD"] == \
                    "switchyard-migrate"
            else:
                assert "switchyard-migrate" not in refs.values(), obj["metadata"]["name"]
    app_url = yaml.safe_load((K8S / "secret.example.yaml").read_text())["stringData"]["SWITCHYARD_DATABASE_URL"]
    assert app_url.startswith("postgresql://switchyard_app:"), secrets


def test_gateway_drains_within_its_grace_and_leaves_jobs_to_their_deployment(rendered):
    _, objects = rendered
    deployments = by_kind(objects, "Deployment")
    gateway = deployments["switchyard-gateway"]["spec"]["template"]["spec"]
    (c,) = gateway["containers"]
    drain = float(env_value(c, "SWITCHYARD_GATEWAY__DRAIN_TIMEOUT_S") or GatewayConfig().drain_timeout_s)
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert gateway["terminationGracePeriodSeconds"] > pre_stop + drain
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    port = int(env_value(c, "SWITCHYARD_GATEWAY__PORT") or GatewayConfig().port)
    assert container_port(c, c["readinessProbe"]["httpGet"]["port"]) == port
    assert env_value(c, "SWITCHYARD_GATEWAY__HOST") == "0.0.0.0"
    # --no-jobs only makes sense with the jobs running somewhere else.
    assert "--no-jobs" in c["args"] and "switchyard-jobs" in deployments
    assert by_kind(objects, "HorizontalPodAutoscaler")["switchyard-gateway"]["spec"]["scaleTargetRef"]["name"] \
        == "switchyard-gateway"
    assert "replicas" not in deployments["switchyard-gateway"]["spec"], "the HPA owns replicas"


def test_only_prometheus_and_the_gateways_reach_a_workers_port_and_scrapes_carry_the_token(rendered):
    _, objects = rendered
    policy = by_kind(objects, "NetworkPolicy")["switchyard-worker"]["spec"]
    assert policy["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "switchyard-worker"}
    assert policy["policyTypes"] == ["Ingress"] and len(policy["ingress"]) == 1
    sources = policy["ingress"][0]["from"]
    assert {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}} in sources
    assert {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "switchyard-gateway"}}} in sources
    assert policy["ingress"][0]["ports"] == [{"port": "metrics"}]
    [endpoint] = by_kind(objects, "PodMonitor")["switchyard-worker"]["spec"]["podMetricsEndpoints"]
    assert endpoint["authorization"]["credentials"] == {"name": "switchyard", "key": "SWITCHYARD_WORKER__STATUS_TOKEN"}


def test_worker_is_ready_when_it_serves_and_drains_before_it_stops(rendered):
    name, objects = rendered
    workers = {n: d for n, d in by_kind(objects, "Deployment").items() if n.startswith("switchyard-worker-")}
    assert workers
    for deployment in workers.values():
        spec = deployment["spec"]["template"]["spec"]
        c = next(c for c in spec["containers"] if c["name"] == "worker")
        port = int(env_value(c, "SWITCHYARD_WORKER__METRICS_PORT"))
        assert port == 9400 and env_value(c, "SWITCHYARD_WORKER__METRICS_HOST") == "0.0.0.0"
        ready, pre_stop = c["readinessProbe"]["httpGet"], " ".join(c["lifecycle"]["preStop"]["exec"]["command"])
        assert ready["path"] == "/readyz" and container_port(c, ready["port"]) == port
        # The drain is asked from inside the pod: a peer on the network needs the status token for it.
        assert f"http://127.0.0.1:{port}/drain" in pre_stop
        assert c["env"][[e["name"] for e in c["env"]].index("SWITCHYARD_WORKER__STATUS_TOKEN")]["valueFrom"]
        drain = float(env_value(c, "SWITCHYARD_WORKER__DRAIN_TIMEOUT_S") or WorkerConfig().drain_timeout_s)
        assert spec["terminationGracePeriodSeconds"] > drain
        assert "replicas" not in deployment["spec"], "KEDA owns replicas"
        claims = {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v}
        assert claims and claims <= set(by_kind(objects, "PersistentVolumeClaim"))
        # Workers need NATS only.
        assert env_value(c, "SWITCHYARD_DATABASE_URL") is None
        assert not any(e["name"] == "SWITCHYARD_DATABASE_URL" for e in c.get("env", []))
        gpus = c["resources"]["limits"].get("nvidia.com/gpu")
        if name.startswith("gpu"):
            assert env_value(c, "SWITCHYARD_WORKER__DEVICE") == "cuda"
            if env_value(c, "SWITCHYARD_WORKER__ENGINE") == "vllm":  # as many GPUs as vLLM splits the model over
                vllm = VllmSettings(**json.loads(env_value(c, "SWITCHYARD_WORKER__VLLM")))
                assert gpus == vllm.tensor_parallel_size * vllm.pipeline_parallel_size and "vllm" in c["image"]
                assert {"/dev/shm"} <= {m["mountPath"] for m in c["volumeMounts"]}  # NCCL between ranks
            else:
                assert gpus == 1 and "cuda" in c["image"]
        else:
            assert gpus is None and env_value(c, "SWITCHYARD_WORKER__DEVICE") == "cpu"
            assert c["resources"]["requests"]["cpu"] == c["resources"]["limits"]["cpu"]
            assert env_value(c, "SWITCHYARD_WORKER__TORCH_THREADS") == str(c["resources"]["limits"]["cpu"])


def test_monitors_and_services_select_pods_that_exist(rendered):
    _, objects = rendered
    pod_labels = [pod_spec_labels for o in objects if pod_spec(o) is not None
                  for pod_spec_labels in [o["spec"]["template"]["metadata"]["labels"]]]

    def selects_some(selector: dict) -> bool:
        return any(selector.items() <= labels.items() for labels in pod_labels)

    for kind in ("Service", "PodDisruptionBudget"):
        for obj in by_kind(objects, kind).values():
            selector = obj["spec"]["selector"]
            assert selects_some(selector.get("matchLabels", selector)), obj["metadata"]["name"]
    for kind in ("ServiceMonitor", "PodMonitor"):
        for obj in by_kind(objects, kind).values():
            assert selects_some(obj["spec"]["selector"]["matchLabels"]), obj["metadata"]["name"]
    services = by_kind(objects, "Service")
    for monitor in by_kind(objects, "ServiceMonitor").values():
        ports = {p["name"] for s in services.values() if monitor["spec"]["selector"]["matchLabels"].items()
                 <= s["metadata"].get("labels", {}).items() for p in s["spec"]["ports"]}
        assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


@pytest.fixture(scope="module")
def disaggregated(tmp_path_factory) -> list[dict]:
    return _render("gpu-disagg", tmp_path_factory)


def _worker_config(container: dict, monkeypatch) -> WorkerConfig:
    """The worker's settings as the pod's own environment gives them (the ConfigMap's are the base's)."""
    for e in container["env"]:
        if e["name"].startswith("SWITCHYARD_WORKER__") and "value" in e:
            monkeypatch.setenv(e["name"], e["value"])
    return SwitchyardConfig().worker


def test_the_disaggregated_overlay_runs_a_prefill_and_a_decode_pool_with_vllms_connector(disaggregated,
                                                                                         monkeypatch):
    """Each pool's settings parse as our WorkerConfig with its role, give vLLM the NIXL connector in that role (and
    nothing the connector refuses beside it, as KV offloading), with the same tensor parallel size on both sides, and
    NIXL's side channel on the pod's own address and a port it declares."""
    deployments = by_kind(disaggregated, "Deployment")
    pools = {}
    for role in ("prefill", "decode"):
        c = next(c for c in pod_spec(deployments[f"switchyard-worker-llama-70b-{role}"])["containers"]
                 if c["name"] == "worker")
        with monkeypatch.context() as env:
            worker = _worker_config(c, env)
        assert (worker.role, worker.engine, worker.served_name) == (role, "vllm", "llama-70b")
        kwargs = engine_kwargs(worker, worker.model, on_gpu=True)
        assert kwargs["kv_transfer_config"]["kv_connector"] == "NixlConnector"
        assert kwargs["kv_transfer_config"]["kv_role"] == kv_transfer.KV_ROLES[role]
        assert role in kv_transfer.connector_roles(kwargs)
        assert "kv_offloading_size" not in kwargs and "speculative_config" not in kwargs
        # vLLM 0.32 reads these two (vllm/envs.py); localhost, its default, reaches no other pod.
        host = next(e for e in c["env"] if e["name"] == "VLLM_NIXL_SIDE_CHANNEL_HOST")
        assert host["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
        assert int(env_value(c, "VLLM_NIXL_SIDE_CHANNEL_PORT")) == container_port(c, "nixl")
        pools[role] = worker
    assert pools["prefill"].vllm.tensor_parallel_size == pools["decode"].vllm.tensor_parallel_size
    assert pools["prefill"].vllm.kv_cache_dtype == pools["decode"].vllm.kv_cache_dtype  # blocks read as they are


def test_the_pools_reach_each_other_for_the_kv_and_scale_on_their_own_queues(disaggregated):
    deployments = by_kind(disaggregated, "Deployment")
    policy = by_kind(disaggregated, "NetworkPolicy")["switchyard-worker-kv-transfer-llama-70b"]["spec"]
    selected = {name for name, d in deployments.items()
                if policy["podSelector"]["matchLabels"].items() <= d["spec"]["template"]["metadata"]["labels"].items()}
    assert selected == {"switchyard-worker-llama-70b-prefill", "switchyard-worker-llama-70b-decode"}
    assert policy["ingress"] == [{"from": [{"podSelector": policy["podSelector"]}]}]  # one another only, any port
    # KEDA per pool: the prefill pool on its model's prefill queue, the decode pool on the model's own queue, each
    # as deploy/k8s_scaling.py renders it.
    scaled = by_kind(disaggregated, "ScaledObject")
    for role, model in (("prefill", prefill_queue("llama-70b")), ("decode", "llama-70b")):
        name = f"switchyard-worker-llama-70b-{role}"
        committed = K8S / "components" / "vllm-disagg" / f"worker-scaledobject-llama-70b-{role}.yaml"
        rendered = k8s_scaling.render(model, name, ["--model", model, "--deployment", name])
        assert committed.read_text() == rendered, f"stale: render {committed.name} again"
        assert scaled[name]["spec"]["scaleTargetRef"]["name"] == name and name in deployments


def test_cnpg_component_points_every_database_user_at_the_operators_secret(with_cnpg):
    (cluster,) = by_kind(with_cnpg, "Cluster").values()
    secret = f"{cluster['metadata']['name']}-app"  # CloudNativePG's app-user Secret, key `uri`
    users = []
    for obj in with_cnpg:
        spec = pod_spec(obj)
        for c in containers(spec) if spec else []:
            for e in c.get("env", []):
                if e["name"] == "SWITCHYARD_DATABASE_URL":
                    assert e["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "uri"}, obj["metadata"]["name"]
                    users.append(obj["metadata"]["name"])
    assert sorted(users) == ["switchyard-gateway", "switchyard-jobs", "switchyard-migrate"]


# -- NATS chart values ------------------------------------------------------------------------------------------
# The chart's top-level values (nats-io/k8s helm/charts/nats values.yaml, chart 2.x): a misspelled key is ignored
# by Helm without a word.
NATS_CHART_KEYS = {"global", "nameOverride", "fullnameOverride", "namespaceOverride", "tlsCA", "config", "container",
                   "reloader", "promExporter", "service", "statefulSet", "podTemplate", "headlessService",
                   "configMap", "podDisruptionBudget", "serviceAccount", "natsBox", "extraResources"}


def test_nats_values_run_a_three_node_authenticated_jetstream_cluster():
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    assert set(values) <= NATS_CHART_KEYS, set(values) - NATS_CHART_KEYS
    config = values["config"]
    assert config["cluster"]["enabled"] and config["cluster"]["replicas"] == 3
    assert config["jetstream"]["enabled"] and config["jetstream"]["fileStore"]["enabled"]
    assert config["jetstream"]["fileStore"]["pvc"]["enabled"]
    assert config["monitor"]["enabled"]
    accounts = config["merge"]["accounts"]
    assert accounts["SWITCHYARD"]["jetstream"] == "enabled" and accounts["SWITCHYARD"]["users"]
    assert config["merge"]["system_account"] in accounts
    # Passwords come from the environment, never from the file.
    for account in accounts.values():
        for user in account["users"]:
            assert user["password"].startswith("<< $"), user["user"]
            assert user["password"].removeprefix("<< $").removesuffix(" >>") in values["container"]["env"]
    replicas = yaml.safe_load((K8S / "base" / "config.yaml").read_text())["data"]["SWITCHYARD_NATS_REPLICAS"]
    assert int(replicas) <= config["cluster"]["replicas"]


def test_nats_users_hold_each_role_to_its_permissions_and_each_pod_connects_as_its_role(rendered):
    from switchyard.deploy.credentials import PERMISSIONS

    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    users = {u["user"]: u for u in values["config"]["merge"]["accounts"]["SWITCHYARD"]["users"]}
    for role in ("gateway", "worker"):
        assert users[role]["permissions"] == PERMISSIONS[role], role
        assert not any(p.startswith("$JS.API.>") for p in users[role]["permissions"]["publish"])
    secrets = {path.name: yaml.safe_load(path.read_text())["stringData"] for path in K8S.glob("secret*.example.yaml")}
    assert secrets["secret.example.yaml"]["SWITCHYARD_NATS_URL"].startswith("nats://gateway:")
    assert secrets["secret-worker.example.yaml"]["SWITCHYARD_NATS_URL"].startswith("nats://worker:")
    _, objects = rendered
    for obj in objects:
        if pod_spec(obj) is None:
            continue
        for c in pod_spec(obj)["containers"]:
            for e in c.get("env", []):
                if e["name"] == "SWITCHYARD_NATS_URL":
                    worker = obj["metadata"]["name"].startswith("switchyard-worker")
                    assert e["valueFrom"]["secretKeyRef"]["name"] == ("switchyard-worker" if worker else "switchyard")


def test_nats_values_config_is_one_nats_server_accepts(tmp_path):
    """The chart renders ``config.merge`` into nats.conf as JSON, unwrapping ``<< ... >>`` into raw variables and
    units; the same here, checked by the nats-server the project already depends on."""
    values = yaml.safe_load((K8S / "nats-values.yaml").read_text())
    server = shutil.which("nats-server", path=os.path.dirname(sys.executable))
    if server is None:
        pytest.skip("nats-server not installed")
    conf = tmp_path / "nats.conf"
    conf.write_text(re.sub(r'"<< (.+?) >>"', r"\1", json.dumps(values["config"]["merge"], indent=2)))
    # The container's environment as the chart sets it (a Secret's value stands in as "x").
    env = {**os.environ, **{k: v if isinstance(v, str) else "x" for k, v in values["container"]["env"].items()}}
    proc = subprocess.run([server, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30, env=env)
    assert proc.returncode == 0, proc.stderr + proc.stdout


# -- the checks can fail ----------------------------------------------------------------------------------------
def test_validation_rejects_a_misspelled_field():
    (deployment,) = load_yaml_documents(K8S / "base" / "gateway-deployment.yaml")
    broken = copy.deepcopy(deployment)
    spec = broken["spec"]["template"]["spec"]
    spec["terminationGracePeriodSecond"] = spec.pop("terminationGracePeriodSeconds")
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_object(broken)


def test_crd_validation_rejects_unknown_fields_and_wrong_types():
    (scaled,) = load_yaml_documents(K8S / "base" / "worker-scaledobject.yaml")
    typo = copy.deepcopy(scaled)
    typo["spec"]["minReplicas"] = typo["spec"].pop("minReplicaCount")
    number = copy.deepcopy(scaled)
    number["spec"]["triggers"][0]["metadata"]["lagThreshold"] = 4  # KEDA's metadata is strings only
    for broken in (typo, number):
        with pytest.raises(jsonschema.ValidationError):
            validate_object(broken)
    assert not is_setting("SWITCHYARD_WORKER__DRAIN_TIMEOUT") and not is_setting("SWITCHYARD_NAT_URL")
    assert not image_has_tag("switchyard") and not image_has_tag("nginx:latest")
    assert image_has_tag("registry:5000/switchyard:0.1.0-cpu")
