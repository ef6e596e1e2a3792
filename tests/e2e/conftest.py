"""The whole system as real processes: a worker on the tiny test model and a gateway, against the session's
real NATS and Postgres. Both are stopped by PID at the end of the session."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest

from switchyard.deploy.services import ServiceProcess
from switchyard.deploy.system import LocalSystem
from switchyard.migrations import apply_migrations
from switchyard.shared.config import GatewayConfig, SwitchyardConfig, WorkerConfig
from tests.support.databases import own_database
from tests.support.system import free_port, make_key
from tests.support.tiny_model import save_tiny_model

TINY = "tiny"
TINY_CONTEXT = 4096
ADMIN_KEY = "test-admin-key"
_running_system: System | None = None  # for failure reports of tests that use only `system` or `client`



class System(LocalSystem):
    """The running e2e system: a gateway (``base_url``) on the tiny model, and more workers or gateways on demand."""

    def start_worker(self, served_name: str, max_num_seqs: int, **settings) -> ServiceProcess:
        return super().start_worker(f"worker-{served_name}", served_model_name=served_name,
                                    max_num_seqs=max_num_seqs, **settings)

    @property
    def work(self) -> Path:
        return self.config.data_dir

    @property
    def base_url(self) -> str:
        return self.url()


@pytest.fixture(scope="session")
async def database_url(_postgres_url: str):
    """The end-to-end systems' own database (migrated) on the session's server. Their gateways' batch runners and
    sweepers act on every row they find, for the whole session; tests elsewhere write rows straight into the
    session's database (a batch left ``validating`` there was once failed by this system's runner)."""
    async with own_database(_postgres_url, "e2e") as url:
        await apply_migrations(url)
        yield url


@pytest.fixture(scope="session")
def e2e(nats_url: str, database_url: str):
    """A running gateway with one worker serving the tiny model as ``tiny``."""
    global _running_system
    work = Path(tempfile.mkdtemp(prefix="switchyard-e2e-"))
    # A long context, so a stream can be cancelled long before it could finish on its own.
    model_dir = save_tiny_model(work / "tiny-model", max_context=TINY_CONTEXT)
    config = SwitchyardConfig(
        data_dir=work, nats_url=nats_url, database_url=database_url,
        gateway=GatewayConfig(port=free_port(), queue_timeout_s=20, admin_key=ADMIN_KEY, allow_tier_header=True),
        worker=WorkerConfig(model=str(model_dir), dtype="float32"))
    system = System(config, log_dir=work, log_level=os.environ.get("SWITCHYARD_E2E_LOG_LEVEL", "WARNING"))
    try:
        system.start_worker(TINY, max_num_seqs=4)
        system.start_gateway()
        _running_system = system
        system.wait_until_ready(TINY, timeout_s=120)
        yield system
    finally:
        _running_system = None
        system.stop()
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
