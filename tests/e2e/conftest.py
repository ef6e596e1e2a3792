"""The whole system as real processes: a worker on the tiny test model and a gateway, against the session's
real NATS and Postgres. Both are stopped by PID at the end of the session."""

from __future__ import annotations

import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from deploy.services import ServiceProcess, wait_until_ready
from workers.tiny_model import save_tiny_model

TINY = "tiny"
TINY_CONTEXT = 4096


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def system(nats_url: str, database_url: str):
    """Base URL of a running gateway with one worker serving the tiny model as ``tiny``."""
    work = Path(tempfile.mkdtemp(prefix="switchyard-e2e-"))
    services: list[ServiceProcess] = []
    try:
        # A long context, so a stream can be cancelled long before it could finish on its own.
        model_dir = save_tiny_model(work / "tiny-model", max_context=TINY_CONTEXT)
        common = ["--data-dir", str(work), "--nats-url", nats_url, "--database-url", database_url,
                  "--log-level", "WARNING"]
        services.append(ServiceProcess(
            "worker", ["worker", *common, "--model", str(model_dir), "--served-model-name", TINY,
                       "--dtype", "float32", "--max-num-seqs", "4"],
            log_path=work / "worker.log").start())
        port = _free_port()
        services.append(ServiceProcess(
            "gateway", ["gateway", *common, "--port", str(port)], log_path=work / "gateway.log",
            env={"SWITCHYARD_GATEWAY__QUEUE_TIMEOUT_S": "20"}).start())
        base_url = f"http://127.0.0.1:{port}"
        wait_until_ready(base_url, TINY, timeout_s=120, watch=services)
        yield base_url
    finally:
        for svc in reversed(services):
            svc.stop()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="session")
def client(system: str):
    from openai import OpenAI

    with OpenAI(base_url=f"{system}/v1", api_key="unused", max_retries=0, timeout=60) as c:
        yield c
