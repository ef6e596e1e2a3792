"""Text Postgres or NATS cannot take, sent as a hostile tenant would: every stored field with U+0000 (and a lone
surrogate anywhere) through chat, completions, conversations, files and batch lines is a 400 naming the field,
never a 500, a request served and left unbilled, or a batch stuck in ``validating``; a hypothesis run over every
stored field with the code points Postgres refuses. The usage writer bills a record Postgres still refuses from
what it knows."""

from __future__ import annotations

import json
import time
import uuid

import asyncpg
import httpx
import nats
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from switchyard.shared import subjects
from switchyard.shared.messages import UsageRecord, encode
from tests.support.system import poll, wait_usage_written

MODEL = "tiny"
NUL = "\u0000"


def bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2, **extra}


def completion(**extra) -> dict:
    return {"model": MODEL, "prompt": "hello", "max_tokens": 2, **extra}


def post(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800, as a hostile client would send it (httpx's json= cannot).
    return http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


def refused(response: httpx.Response, param: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_value" and error["param"] == param, error


# Every field a request body stores (requests.end_user and .metadata, conversations, their messages), as
# (path, a body with ``text`` in that field, the param the refusal names). {conv} is a conversation of the tenant.
STORED_FIELDS = [
    ("/v1/chat/completions", lambda t: chat(user=t), "user"),
    ("/v1/chat/completions", lambda t: chat(safety_identifier=t), "safety_identifier"),
    ("/v1/chat/completions", lambda t: chat(metadata={"k": t}), "metadata.k"),
    ("/v1/chat/completions", lambda t: chat(metadata={t: "v"}), "metadata"),
    ("/v1/chat/completions", lambda t: chat(model=t), "model"),
    ("/v1/completions", lambda t: completion(user=t), "user"),
    ("/v1/conversations", lambda t: {"system": t}, "system"),
    ("/v1/conversations", lambda t: {"model": t}, "model"),
    ("/v1/conversations", lambda t: {"metadata": {"k": t}}, "metadata.k"),
    ("/v1/conversations", lambda t: {"metadata": {t: "v"}}, "metadata"),
    ("/v1/conversations/{conv}/messages", lambda t: {"content": t, "max_tokens": 2}, "content"),
    ("/v1/conversations/{conv}/messages", lambda t: {"content": "hi", "user": t, "max_tokens": 2}, "user"),
    ("/v1/conversations/{conv}/messages", lambda t: {"role": "tool", "tool_call_id": t, "content": "42"},
     "tool_call_id"),
    ("/v1/responses", lambda t: {"model": MODEL, "input": "hi", "max_output_tokens": 2, "user": t}, "user"),
    ("/v1/responses", lambda t: {"model": MODEL, "input": "hi", "max_output_tokens": 2, "instructions": t},
     "instructions"),
    ("/v1/responses", lambda t: {"model": MODEL, "input": "hi", "max_output_tokens": 2, "metadata": {"k": t}},
     "metadata.k"),
    ("/v1/batches", lambda t: {"input_file_id": "file-x", "endpoint": "/v1/chat/completions",
                               "completion_window": "24h", "metadata": {"k": t}}, "metadata.k"),
    ("/v1/batches", lambda t: {"input_file_id": t, "endpoint": "/v1/chat/completions",
                               "completion_window": "24h"}, "input_file_id"),
]


@pytest.fixture(scope="module")
async def hostile(system, new_key):
    """A tenant's HTTP client (generous limits: the fuzz sends many requests) and one conversation of its own."""
    _, secret = await new_key("pro", rpm_limit=10**6, tpm_limit=10**9)
    with httpx.Client(base_url=system, headers=bearer(secret), timeout=60) as http:
        conv = http.post("/v1/conversations", json={"model": MODEL}).json()["id"]
        yield http, conv


@pytest.mark.parametrize(("path", "body", "param"), STORED_FIELDS,
                         ids=[f"{p.rsplit('/', 1)[-1]}-{param}" for p, _, param in STORED_FIELDS])
async def test_a_nul_in_a_stored_field_is_a_400_naming_it(hostile, path, body, param):
    http, conv = hostile
    refused(post(http, path.format(conv=conv), body(f"before {NUL} after")), param)


async def test_a_lone_surrogate_anywhere_is_a_400_naming_where(hostile):
    http, _ = hostile
    body = chat(messages=[{"role": "system", "content": "fine"}, {"role": "user", "content": "bad \ud800 text"}])
    refused(post(http, "/v1/chat/completions", body), "messages.1.content")
    refused(post(http, "/v1/completions", completion(prompt=["ok", "\udfff"])), "prompt.1")


async def test_a_nul_in_a_prompt_is_served_and_billed(hostile, database_url, nats_url):
    """A prompt is not stored as text (it travels in msgpack): U+0000 in it is the user's to send, and billed."""
    http, _ = hostile
    response = post(http, "/v1/chat/completions", chat(messages=[{"role": "user", "content": f"a {NUL} b"}],
                                                        user="alice"))
    assert response.status_code == 200, response.text
    await wait_usage_written(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        row = await conn.fetchrow("SELECT end_user, completion_tokens FROM requests WHERE request_id = $1",
                                  response.headers["x-request-id"])
    finally:
        await conn.close()
    assert row is not None and row["end_user"] == "alice" and row["completion_tokens"] == 2


async def test_urls_with_a_nul_are_a_400(hostile):
    http, conv = hostile
    refused(http.get("/v1/conversations/conv_%00x"), "path")
    refused(http.get(f"/v1/conversations/{conv}/messages", params={"after": f"m{NUL}"}), "after")
    refused(http.get("/v1/files", params={"purpose": NUL}), "purpose")


async def test_a_file_name_with_a_nul_is_a_400(hostile):
    http, _ = hostile
    # By hand: httpx would percent-encode the NUL of the file name.
    boundary = "b0undary"
    form = (f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="in{NUL}.jsonl"\r\n'
            f'Content-Type: application/jsonl\r\n\r\n{{}}\n\r\n--{boundary}--\r\n').encode()
    response = http.post("/v1/files", content=form,
                         headers={"Content-Type": f"multipart/form-data; boundary={boundary}"})
    refused(response, "file")


@pytest.mark.parametrize("start", ["inf", "-inf", "nan", "1e300", "-1e300"])
async def test_usage_times_out_of_any_calendar_are_a_400(hostile, start):
    http, _ = hostile
    refused(http.get("/v1/usage", params={"start": start}), "start")


def line(custom_id: str, **body) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
                       "body": chat(**body)}).encode() + b"\n"


async def test_batch_lines_with_unstorable_text_fail_the_batch_with_their_reasons(hostile):
    """A custom_id with U+0000 once left its batch in ``validating``, parsed again every second for 24 hours."""
    http, _ = hostile
    content = line(f"id-{NUL}") + line("ok") + line("meta", metadata={"k": NUL}) + line("who", user=f"{NUL}")
    file_id = http.post("/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content)}).json()["id"]
    batch = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/chat/completions",
                                           "completion_window": "24h"}).json()

    async def state():
        return http.get(f"/v1/batches/{batch['id']}").json()

    done = await poll(state, lambda b: b["status"] != "validating", timeout_s=30, what="the batch left validating")
    assert done["status"] == "failed", done
    errors = {e["line"]: (e["code"], e["param"]) for e in done["errors"]["data"]}
    assert errors == {1: ("invalid_value", "custom_id"), 3: ("invalid_request", "body.metadata.k"),
                      4: ("invalid_request", "body.user")}, errors


# Hypothesis: any text with at least one code point Postgres refuses, placed anywhere in any stored field.
_refused_char = st.sampled_from([NUL, "\ud800", "\udbff", "\udc00", "\udfff"])
_text = st.tuples(st.text(max_size=20), _refused_char, st.text(max_size=20)).map("".join)


@given(field=st.sampled_from(STORED_FIELDS), text=_text)
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
def test_fuzz_every_stored_field_with_refused_code_points(hostile_sync, field, text):
    http, conv = hostile_sync
    path, body, param = field
    response = post(http, path.format(conv=conv), body(text))
    assert response.status_code == 400, (path, param, repr(text), response.text)
    error = response.json()["error"]
    assert error["code"] == "invalid_value", (path, repr(text), error)
    # A surrogate anywhere is named where it is; a NUL by the field that would store it.
    assert error["param"] == param or error["param"].startswith(param.split(".")[0]), (path, repr(text), error)


@pytest.fixture(scope="module")
def hostile_sync(hostile):
    """The same client for the (synchronous) hypothesis test."""
    return hostile


async def test_a_usage_record_postgres_refuses_is_billed_from_what_is_known(e2e, nats_url, database_url):
    """A record with U+0000 in its end user and metadata (from a gateway that let it through) and one with a
    created_at no date can hold: both billed with their tokens, tenant and model; the originals kept as dead
    letters with the reason."""
    tenant = f"ten_{uuid.uuid4().hex[:8]}"

    def record(**fields) -> UsageRecord:
        return UsageRecord(**{"request_id": uuid.uuid4().hex, "model": MODEL, "tier": "pro", "prompt_tokens": 5,
                              "completion_tokens": 2, "finish_reason": "stop", "created_at": time.time(),
                              "queue_ms": 1.0, "first_token_ms": 2.0, "total_ms": 3.0, "tenant_id": tenant,
                              **fields})

    records = [record(end_user=f"a{NUL}b", metadata={"k": NUL}), record(created_at=1e300), record()]
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        dead = await js.subscribe(subjects.dead_letter_subject("usage record"), ordered_consumer=True)
        for r in records:
            await js.publish(subjects.USAGE_SUBJECT, encode(r), headers={"Nats-Msg-Id": r.request_id})
        letters = [await dead.next_msg(timeout=20) for _ in range(2)]
        assert {m.data for m in letters} == {encode(records[0]), encode(records[1])}
        assert all("written salvaged" in m.headers["Switchyard-Error"] for m in letters), [m.headers for m in letters]
        await wait_usage_written(nats_url)
    finally:
        await nc.close()
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT request_id, prompt_tokens, completion_tokens, end_user, metadata FROM "
                                "requests WHERE tenant_id = $1", tenant)
    finally:
        await conn.close()
    billed = {r["request_id"]: r for r in rows}
    assert set(billed) == {r.request_id for r in records}
    assert all((r["prompt_tokens"], r["completion_tokens"]) == (5, 2) for r in rows)
    assert billed[records[0].request_id]["end_user"] is None and billed[records[0].request_id]["metadata"] is None
