"""schemathesis against the running gateway's own OpenAPI schema (real NATS, Postgres and worker behind it): for
every /v1 operation, generated requests, valid and not, never get a 5xx, and every refusal is an OpenAI-shaped
error. The schema describes the real request bodies (the multipart upload included), so the cases reach the
handlers rather than stopping at a generic validation error."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from switchyard.gateway.app import create_app
from switchyard.shared.config import SwitchyardConfig

MAX_TOKENS = 8  # a generated max_tokens can be the whole context: the fuzz is about the edge, not the model
SERVED = "tiny"  # the e2e worker's model: a body naming it goes all the way to the worker and back



def _gateway_schema():
    """The schema the gateway serves at /openapi.json, built from the app itself (the running gateway's URL is only
    known once the e2e system is up, and schemathesis' lazy fixture loader does not run on pytest 9)."""
    app = create_app(SwitchyardConfig(nats_url="nats://unused:4222", database_url="postgresql://unused/db"))
    # /admin changes live tier limits other tests rely on; health checks take no input.
    return schemathesis.openapi.from_dict(app.openapi()).include(path_regex=r"^/v1/")


schema = _gateway_schema()


@pytest.fixture(scope="module")
async def fuzz_auth(new_key) -> dict[str, str]:
    """A key of its own, with limits no fuzzing reaches: the session's key is shared with the other tests."""
    _, secret = await new_key("pro", rpm_limit=10**6, tpm_limit=10**9)
    return {"Authorization": f"Bearer {secret}"}


def _bounded(body):
    if isinstance(body, dict):
        if isinstance(body.get("model"), str):
            body["model"] = SERVED
        for field in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(field), int) and body[field] > MAX_TOKENS:
                body[field] = MAX_TOKENS
    return body


@schema.parametrize()
@settings(max_examples=8, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_no_input_gets_a_server_error_and_every_refusal_is_openai_shaped(case, system, fuzz_auth):
    if case.body is not None and not isinstance(case.body, (bytes, str)):
        case.body = _bounded(case.body)
    response = case.call(base_url=system, headers=fuzz_auth, timeout=60)
    assert response.status_code < 500, f"{case.method} {case.formatted_path}: {response.status_code} {response.text}"
    if response.status_code >= 400:
        error = response.json().get("error")
        assert isinstance(error, dict) and isinstance(error.get("message"), str) and "type" in error \
            and "code" in error, f"{case.method} {case.formatted_path}: not an OpenAI error: {response.text}"
