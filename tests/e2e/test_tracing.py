"""One request's trace spans the gateway and the worker: the trace context crosses NATS in the request message's
headers. Both processes append their spans to one JSON-lines file (traces_exporter=file)."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import httpx

from switchyard.deploy.system import LocalSystem
from switchyard.shared.config import GatewayConfig
from tests.support.system import free_port

MODEL = "tiny-traced"  # a model of its own: the session's gateway never routes to this worker


def read_spans(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_one_trace_spans_gateway_and_worker(e2e, api_key):
    work = Path(tempfile.mkdtemp(prefix="switchyard-trace-"))
    traces = work / "traces.jsonl"
    config = e2e.config.model_copy(update={
        "data_dir": work, "traces_exporter": "file", "traces_file": traces,
        "gateway": GatewayConfig(port=free_port(), run_jobs=False, queue_timeout_s=20),
    })
    try:
        with LocalSystem(config, log_dir=work, log_level="WARNING") as system:
            system.start_worker("worker-traced", served_model_name=MODEL, max_num_seqs=2)
            system.start_gateway()
            system.wait_until_ready(MODEL, timeout_s=120)
            response = httpx.post(f"{system.url()}/v1/chat/completions", timeout=60,
                                  headers={"Authorization": f"Bearer {api_key}"},
                                  json={"model": MODEL, "messages": [{"role": "user", "content": "trace me"}],
                                        "max_tokens": 5, "temperature": 0, "ignore_eos": True})
            assert response.status_code == 200, response.text
            request_id = response.headers["X-Request-Id"]
            # The worker records its spans as it publishes the final delta, the gateway its root span as the
            # response ends: both are written by now or within moments.
            deadline = time.monotonic() + 20
            while not {"decode", "POST /v1/chat/completions"} <= {s["name"] for s in read_spans(traces)}:
                assert time.monotonic() < deadline, f"spans written: {[s['name'] for s in read_spans(traces)]}"
                time.sleep(0.1)
        spans = read_spans(traces)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    by_name = {s["name"]: s for s in spans}
    root = by_name["POST /v1/chat/completions"]
    trace_id = root["context"]["trace_id"]
    assert root["parent_id"] is None, [(s["name"], s["context"]["span_id"], s["parent_id"]) for s in spans]
    assert root["attributes"]["http.response.status_code"] == 200
    services = {s["name"]: s["resource"]["attributes"]["service.name"] for s in spans}
    assert {services[n] for n in ("POST /v1/chat/completions", "authenticate", "rate_limits", "publish")} == \
        {"switchyard-gateway"}
    assert {services[n] for n in ("queue", "generate", "prefill", "decode")} == {"switchyard-worker"}
    # One trace, and each span where it belongs: the worker's under the gateway's publish.
    assert {s["context"]["trace_id"] for s in spans} == {trace_id}

    def parent(name: str) -> str:
        return by_name[name]["parent_id"]

    span_id = {name: s["context"]["span_id"] for name, s in by_name.items()}
    assert parent("authenticate") == parent("rate_limits") == parent("publish") == span_id[root["name"]]
    assert parent("queue") == parent("generate") == span_id["publish"]
    assert parent("prefill") == parent("decode") == span_id["generate"]
    assert by_name["publish"]["attributes"]["request_id"] == request_id
    assert by_name["generate"]["attributes"]["completion_tokens"] == 5
    assert by_name["generate"]["attributes"]["finish_reason"] == "length"
