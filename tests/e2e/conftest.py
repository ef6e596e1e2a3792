"""The whole system as real processes: a worker on the tiny test model and a gateway, against the session's
real NATS and Postgres. Both are stopped by PID at the end of the session."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from switchyard.deploy.services import ServiceProcess, wait_until_ready
from tests.support.system import free_port, make_key
from tests.support.tiny_model import save_tiny_model

TINY = "tiny"
TINY_CONTEXT = 4096
ADMIN_KEY = "test-admin-key"
_running_system: "System | None" = None  # for failure reports of tests that use only `system` or `client`



@dataclass
class System:
    """A running gateway (``base_url``) and what it takes to add workers to it."""

    base_url: str
    work: Path
    model_dir: Path
    common_args: list[str]
    services: list[ServiceProcess]

    def start_worker(self, served_name: str, max_num_seqs: int) -> ServiceProcess:
        worker = ServiceProcess(
            f"worker-{served_name}",
            ["worker", *self.common_args, "--model", str(self.model_dir), "--served-model-name", served_name,
             "--dtype", "float32", "--max-num-seqs", str(max_num_seqs)],
            log_path=self.work / f"worker-{served_name}.log").start()
        self.services.append(worker)
        return worker


@pytest.fixture(scope="session")
def e2e(nats_url: str, database_url: str):
    """A running gateway with one worker serving the tiny model as ``tiny``."""
    global _running_system
    work = Path(tempfile.mkdtemp(prefix="switchyard-e2e-"))
    services: list[ServiceProcess] = []
    try:
        # A long context, so a stream can be cancelled long before it could finish on its own.
        model_dir = save_tiny_model(work / "tiny-model", max_context=TINY_CONTEXT)
        common = ["--data-dir", str(work), "--nats-url", nats_url, "--database-url", database_url,
                  "--log-level", os.environ.get("SWITCHYARD_E2E_LOG_LEVEL", "WARNING")]
        system = System("", work, model_dir, common, services)
        system.start_worker(TINY, max_num_seqs=4)
        port = free_port()
        services.append(ServiceProcess(
            "gateway", ["gateway", *common, "--port", str(port)], log_path=work / "gateway.log",
            env={"SWITCHYARD_GATEWAY__QUEUE_TIMEOUT_S": "20", "SWITCHYARD_GATEWAY__ADMIN_KEY": ADMIN_KEY,
                 "SWITCHYARD_GATEWAY__ALLOW_TIER_HEADER": "true"}).start())
        system.base_url = f"http://127.0.0.1:{port}"
        _running_system = system
        wait_until_ready(system.base_url, TINY, timeout_s=120, watch=services)
        yield system
    finally:
        _running_system = None
        for svc in reversed(services):
            svc.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failing end-to-end test carries the tails of the services' logs in its report: the fastest way to the
    cause, and the only one once CI has removed the temp dir."""
    outcome = yield
    report = outcome.get_result()
    if report.when == "call" and report.failed and _running_system is not None:
        for svc in _running_system.services:
            tail = svc.log_tail(25)
            if tail:
                report.sections.append((f"{svc.name} log (tail)", tail))


@pytest.fixture(scope="session")
def system(e2e: System) -> str:
    """Base URL of the running gateway."""
    return e2e.base_url


@pytest.fixture(scope="session")
def new_key(database_url: str):
    """``await new_key(tier="pro", **limits) -> (tenant_name, secret)``: a fresh tenant with one key."""

    async def make(tier: str = "pro", **limits) -> tuple[str, str]:
        tenant = f"t-{uuid.uuid4().hex[:8]}"
        return tenant, await make_key(database_url, tenant, tier, **limits)

    return make


@pytest.fixture(scope="session")
async def api_key(database_url: str) -> str:
    """A key of the `e2e` tenant (pro tier, the tier's default limits)."""
    return await make_key(database_url, "e2e", "pro")


@pytest.fixture(scope="session")
def auth(api_key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"}


@pytest.fixture(scope="session")
def client(system: str, api_key: str):
    from openai import OpenAI

    with OpenAI(base_url=f"{system}/v1", api_key=api_key, max_retries=0, timeout=60) as c:
        yield c
