"""Logs as a pipeline reads them: a gateway started with log_format=json writes one JSON object a line, its
request's lines carry the request id, probes leave no access lines, and no prompt reaches the log."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import httpx

from switchyard.deploy.system import LocalSystem
from switchyard.shared.config import GatewayConfig
from tests.e2e.conftest import TINY
from tests.support.system import free_port

SECRET_PROMPT = "my card number is 4111-1111-1111-1111"


def test_json_logs_carry_the_request_id_and_never_the_prompt(e2e, api_key):
    work = Path(tempfile.mkdtemp(prefix="switchyard-logs-"))
    config = e2e.config.model_copy(update={
        "data_dir": work, "log_format": "json",
        "gateway": GatewayConfig(port=free_port(), run_jobs=False, queue_timeout_s=20),
    })
    try:
        with LocalSystem(config, log_dir=work, log_level="INFO") as system:
            system.start_gateway()
            system.wait_until_ready(TINY, timeout_s=60)  # polls /readyz: probes that must leave no line
            with httpx.Client(base_url=system.url(), timeout=60,
                              headers={"Authorization": f"Bearer {api_key}"}) as http:
                assert http.get("/healthz").status_code == 200
                response = http.post("/v1/chat/completions", json={
                    "model": TINY, "messages": [{"role": "user", "content": SECRET_PROMPT}], "max_tokens": 3})
                assert response.status_code == 200, response.text
                request_id = response.headers["X-Request-Id"]
        text = (work / "gateway.log").read_text()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    lines = [json.loads(line) for line in text.splitlines() if line.strip()]  # every line is one JSON object
    assert lines and all({"time", "level", "logger", "message"} <= line.keys() for line in lines)
    access = [line for line in lines if line["logger"] == "uvicorn.access"]
    assert [line.get("request_id") for line in access if "/v1/chat/completions" in line["message"]] == \
        [request_id]
    assert not any(path in line["message"] for line in access for path in ("/healthz", "/readyz"))
    assert SECRET_PROMPT not in text and "4111" not in text
