"""The Batch API end to end with the official ``openai`` client: files, batches, results, validation errors,
cancellation, tenant isolation, a worker killed mid-batch (every line still answered and billed exactly once),
and the ``switchyard batch`` CLI."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys

import asyncpg
import openai
import pytest
from openai import OpenAI

from switchyard.deploy.services import wait_until_ready
from tests.support.system import poll, wait_usage_written

MODEL = "tiny"  # the session's worker (4 slots)
SLOW = "tiny-batch"  # this module's own worker: one slot, so a big batch really queues


def chat_line(custom_id: str, max_tokens: int = 4, model: str = MODEL, content: str = "hello") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
                     "temperature": 0, "ignore_eos": True}}


def jsonl(lines: list) -> bytes:
    return b"".join((line if isinstance(line, str) else json.dumps(line)).encode() + b"\n" for line in lines)


def parse_jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode().splitlines() if line.strip()]


def submit(client: OpenAI, lines: list, endpoint: str = "/v1/chat/completions", **extra):
    f = client.files.create(file=("input.jsonl", jsonl(lines)), purpose="batch")
    return f, client.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h", **extra)


async def wait_batch(client: OpenAI, batch_id: str, until, timeout_s: float = 120.0, what: str = "state"):
    """Poll the batch until ``until(batch)``; the client is synchronous, so each poll runs in a thread."""
    return await poll(lambda: asyncio.to_thread(client.batches.retrieve, batch_id), until, timeout_s,
                      interval_s=0.2,
                      what=lambda b: f"batch {batch_id} did not reach {what}: {b.status} {b.request_counts}")


def finished(batch) -> bool:
    return batch.status in ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def slow_worker(e2e):
    worker = e2e.start_worker(SLOW, max_num_seqs=1)
    wait_until_ready(e2e.base_url, SLOW, timeout_s=120, watch=[worker])
    yield worker
    worker.stop()


@pytest.fixture
async def tenant_client(system, new_key):
    """A fresh tenant's client, so billing rows and listings belong to this test alone."""
    _, secret = await new_key()
    with OpenAI(base_url=f"{system}/v1", api_key=secret, max_retries=0, timeout=60) as c:
        yield c


async def test_batch_runs_to_completion_with_openai_client(tenant_client, database_url):
    client = tenant_client
    lines = [chat_line(f"req-{i}", max_tokens=3 + i, content=f"question {i}") for i in range(6)]
    f, batch = submit(client, lines, metadata={"job": "nightly"})
    assert f.object == "file" and f.purpose == "batch" and f.bytes == len(jsonl(lines))
    assert batch.object == "batch" and batch.status == "validating" and batch.metadata == {"job": "nightly"}
    assert batch.input_file_id == f.id and batch.endpoint == "/v1/chat/completions"

    done = await wait_batch(client, batch.id, finished, what="an end")
    assert done.status == "completed", done
    assert done.request_counts.total == 6 and done.request_counts.completed == 6 and done.request_counts.failed == 0
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.error_file_id is None
    assert done.model == MODEL and done.usage.output_tokens == sum(3 + i for i in range(6))

    results = parse_jsonl(client.files.content(done.output_file_id).read())
    assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
    for r in results:
        i = int(r["custom_id"].split("-")[1])
        assert r["error"] is None and r["response"]["status_code"] == 200
        body = r["response"]["body"]
        assert body["object"] == "chat.completion" and body["model"] == MODEL
        assert body["choices"][0]["message"]["role"] == "assistant"
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["completion_tokens"] == 3 + i
        assert r["id"] == r["response"]["request_id"] and body["id"] == "chatcmpl-" + r["id"]

    output = client.files.retrieve(done.output_file_id)
    assert output.purpose == "batch_output"
    assert {x.id for x in client.files.list()} >= {f.id, done.output_file_id}
    assert [x.id for x in client.files.list(purpose="batch")] == [f.id]
    assert [b.id for b in client.batches.list()] == [batch.id]

    # Billed on the batch tier, to this tenant, once per line.
    ids = [r["id"] for r in results]
    conn = await asyncpg.connect(database_url)
    try:
        rows = await poll(lambda: conn.fetch("SELECT tier, tenant_id FROM requests WHERE request_id = ANY($1)", ids),
                          lambda rows: len(rows) >= 6, what=lambda rows: f"{len(rows)} of 6 lines billed")
        assert len(rows) == 6 and {r["tier"] for r in rows} == {"batch"} and None not in {r["tenant_id"] for r in rows}
    finally:
        await conn.close()

    assert client.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(f.id)


async def test_completions_endpoint_batch(client):
    # Greedy: the tiny model's sampled text is random, and the output filter's profanity classifier (on by
    # default) once blocked a line after 4 of its 5 tokens.
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions",
              "body": {"model": MODEL, "prompt": "once upon a time", "max_tokens": 5, "ignore_eos": True,
                       "temperature": 0}}
             for i in range(3)]
    _, batch = submit(client, lines, endpoint="/v1/completions")
    done = await wait_batch(client, batch.id, finished, what="an end")
    assert done.status == "completed" and done.request_counts.completed == 3
    for r in parse_jsonl(client.files.content(done.output_file_id).read()):
        body = r["response"]["body"]
        assert body["object"] == "text_completion" and isinstance(body["choices"][0]["text"], str)
        assert body["usage"]["completion_tokens"] == 5


async def test_malformed_input_fails_with_line_numbers(client):
    lines = [
        chat_line("ok-1"),
        "{not json",
        chat_line("ok-1"),  # duplicate custom_id
        {**chat_line("ok-4"), "url": "/v1/embeddings"},
        {"custom_id": "ok-5", "method": "POST", "url": "/v1/chat/completions", "body": {"model": MODEL}},
        {**chat_line("ok-6"), "method": "GET"},
        chat_line("ok-7", model="no-such-model"),
    ]
    _, batch = submit(client, lines)
    done = await wait_batch(client, batch.id, finished, what="an end")
    assert done.status == "failed" and done.failed_at and done.output_file_id is None
    errors = {e.line: e for e in done.errors.data}
    assert sorted(errors) == [2, 3, 4, 5, 6], done.errors
    assert errors[2].code == "invalid_json_line"
    assert errors[3].code == "duplicate_custom_id" and errors[3].param == "custom_id"
    assert errors[4].code == "invalid_url"
    assert errors[5].code == "invalid_request" and errors[5].param == "body.messages"
    assert errors[6].code == "invalid_method"

    # Only well-formed lines left: the unknown model is the failure, on its first line.
    _, batch = submit(client, [chat_line("a"), chat_line("b", model="no-such-model")])
    done = await wait_batch(client, batch.id, finished, what="an end")
    assert done.status == "failed" and [(e.line, e.code) for e in done.errors.data] == [(2, "model_not_found")]


async def test_bad_requests_are_refused_at_once(client):
    f = client.files.create(file=("x.jsonl", jsonl([chat_line("a")])), purpose="batch")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/embeddings", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="1h")
    with pytest.raises(openai.NotFoundError):
        client.batches.create(input_file_id="file-nope", endpoint="/v1/chat/completions", completion_window="24h")
    with pytest.raises(openai.BadRequestError):
        client.files.create(file=("x.jsonl", b"{}"), purpose="fine-tune")


async def test_another_tenant_gets_404(client, tenant_client):
    f, batch = submit(client, [chat_line("mine")])
    for call in (lambda: tenant_client.batches.retrieve(batch.id), lambda: tenant_client.batches.cancel(batch.id),
                 lambda: tenant_client.files.retrieve(f.id), lambda: tenant_client.files.content(f.id),
                 lambda: tenant_client.files.delete(f.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert f.id not in {x.id for x in tenant_client.files.list()}
    assert batch.id not in {b.id for b in tenant_client.batches.list()}
    with pytest.raises(openai.NotFoundError):
        tenant_client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    await wait_batch(client, batch.id, finished, what="an end")


async def test_a_line_too_large_for_one_queue_message_fails_alone(tenant_client):
    lines = [chat_line("small"), chat_line("huge", content="word " * 230_000), chat_line("small-2")]
    _, batch = submit(tenant_client, lines)
    done = await wait_batch(tenant_client, batch.id, finished, what="an end")
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1), done
    errors = parse_jsonl(tenant_client.files.content(done.error_file_id).read())
    assert [e["custom_id"] for e in errors] == ["huge"]
    assert errors[0]["response"]["status_code"] == 413
    assert errors[0]["response"]["body"]["error"]["code"] == "request_too_large", errors[0]


async def test_a_nul_character_in_a_line_is_no_obstacle(tenant_client):
    # JSON allows U+0000 in strings (a user may send it, a model may write it); Postgres jsonb does not.
    _, batch = submit(tenant_client, [chat_line("nul", content="before \u0000 after")])
    done = await wait_batch(tenant_client, batch.id, finished, what="an end")
    assert done.status == "completed" and done.request_counts.completed == 1, done


async def test_cancel_stops_a_running_batch(slow_worker, tenant_client, database_url, nats_url):
    client = tenant_client
    lines = [chat_line(f"c-{i}", max_tokens=40, model=SLOW) for i in range(80)]
    _, batch = submit(client, lines)
    await wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 2,
                     what="two completed lines")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    done = await wait_batch(client, batch.id, finished, what="an end")
    assert done.status == "cancelled" and done.cancelled_at
    counts = done.request_counts
    assert counts.total == 80 and 2 <= counts.completed < 80
    completed = parse_jsonl(client.files.content(done.output_file_id).read())
    assert len(completed) == counts.completed and all(r["response"]["status_code"] == 200 for r in completed)
    cancelled = parse_jsonl(client.files.content(done.error_file_id).read())
    assert len(completed) + len(cancelled) == 80
    assert {r["error"]["code"] for r in cancelled} == {"batch_cancelled"}
    assert client.batches.cancel(batch.id).status == "cancelled"  # again: the same answer, no error

    # Billing: every completed line ran to its end; a cancelled line never did (it never started, or stopped
    # part-way and is billed for that part).
    await wait_usage_written(nats_url)
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT request_id, finish_reason FROM requests WHERE request_id = ANY($1)",
                                [r["id"] for r in completed + cancelled])
    finally:
        await conn.close()
    reasons = {r["request_id"]: r["finish_reason"] for r in rows}
    assert [reasons.get(r["id"]) for r in completed] == ["length"] * len(completed)
    assert {reasons[r["id"]] for r in cancelled if r["id"] in reasons} <= {"cancelled"}


async def test_expired_batch_keeps_finished_lines(slow_worker, tenant_client, database_url):
    client = tenant_client
    _, batch = submit(client, [chat_line(f"e-{i}", max_tokens=40, model=SLOW) for i in range(60)])
    await wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 2,
                     what="two completed lines")
    conn = await asyncpg.connect(database_url)
    try:  # the 24 h window, run out now
        await conn.execute("UPDATE batches SET expires_at = now() WHERE id = $1", batch.id)
    finally:
        await conn.close()
    done = await wait_batch(client, batch.id, finished, what="an end")
    assert done.status == "expired" and done.expired_at
    assert 2 <= done.request_counts.completed < 60
    kept = parse_jsonl(client.files.content(done.output_file_id).read())
    expired = parse_jsonl(client.files.content(done.error_file_id).read())
    assert len(kept) == done.request_counts.completed and len(kept) + len(expired) == 60
    assert {r["error"]["code"] for r in expired} == {"batch_expired"}


async def test_cancelling_a_finished_batch_is_refused(client):
    _, batch = submit(client, [chat_line("x")])
    await wait_batch(client, batch.id, finished, what="an end")
    with pytest.raises(openai.ConflictError):
        client.batches.cancel(batch.id)


async def test_worker_killed_mid_batch_every_line_once(e2e, slow_worker, tenant_client, database_url):
    client = tenant_client
    lines = [chat_line(f"k-{i}", max_tokens=60, model=SLOW) for i in range(12)]
    _, batch = submit(client, lines)
    await wait_batch(client, batch.id, lambda b: b.request_counts and b.request_counts.completed >= 2,
                     what="two completed lines")
    os.kill(slow_worker.pid, signal.SIGKILL)  # mid-line: it has taken one and will never answer it
    replacement = e2e.start_worker(SLOW, max_num_seqs=1)
    try:
        done = await wait_batch(client, batch.id, finished, timeout_s=240, what="an end")
        assert done.status == "completed", done
        assert done.request_counts.completed == 12 and done.request_counts.failed == 0
        results = parse_jsonl(client.files.content(done.output_file_id).read())
        assert sorted(r["custom_id"] for r in results) == sorted(line["custom_id"] for line in lines)
        assert all(r["response"]["body"]["usage"]["completion_tokens"] == 60 for r in results)

        ids = [r["id"] for r in results]
        conn = await asyncpg.connect(database_url)
        try:
            rows = await poll(lambda: conn.fetch("SELECT request_id, completion_tokens FROM requests "
                                                 "WHERE request_id = ANY($1)", ids),
                              lambda rows: len(rows) >= 12, timeout_s=30, what=lambda rows: f"{len(rows)} of 12 billed")
            # Every line billed for exactly the tokens its result reports, the one that ran twice included.
            assert sorted(r["request_id"] for r in rows) == sorted(ids)
            assert [r["completion_tokens"] for r in rows] == [60] * 12
            # At most the line the dead worker was running went out twice (if it died between two lines, none).
            assert await conn.fetchval("SELECT count(*) FROM batch_lines WHERE batch_id = $1 AND attempts > 1",
                                       batch.id) <= 1
        finally:
            await conn.close()
    finally:
        replacement.stop()


async def test_cli_submit_wait_and_results(system, api_key, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_bytes(jsonl([chat_line(f"cli-{i}", model="placeholder") for i in range(3)]))
    out = tmp_path / "out.jsonl"
    common = ["--base-url", f"{system}/v1", "--api-key", api_key]
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "switchyard", "batch", "submit", str(path), "--model", MODEL,
                         "--wait", *common], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    batch_id = proc.stdout.split()[0]
    assert batch_id.startswith("batch_") and "3/3" in proc.stderr
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "switchyard", "batch", "results", batch_id, "-o", str(out), *common],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert sorted(r["custom_id"] for r in parse_jsonl(out.read_bytes())) == ["cli-0", "cli-1", "cli-2"]
    proc = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "switchyard", "batch", "status", batch_id, *common],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "completed" in proc.stdout


async def test_batches_count_against_the_tenants_budget_and_enqueued_token_limit(system, new_key, database_url):
    """A batch is refused (failed, with OpenAI's codes) when the tenant's monthly budget is spent, or when its
    estimated tokens and those of the tenant's batches in progress exceed a day of its tokens-per-minute limit."""
    _, secret = await new_key("pro", tpm_limit=10)  # enqueued limit: 10 x 1440 = 14,400 tokens
    with OpenAI(base_url=f"{system}/v1", api_key=secret, max_retries=0) as client:
        _, big = submit(client, [chat_line(f"r{i}", max_tokens=1000) for i in range(15)])  # ~15,000 tokens
        big = await wait_batch(client, big.id, finished, what="failed")
        assert big.status == "failed" and big.errors.data[0].code == "token_limit_exceeded", big.errors
        _, small = submit(client, [chat_line("ok", max_tokens=4)])
        assert (await wait_batch(client, small.id, finished, what="completed")).status == "completed"

    tenant, secret = await new_key("pro", monthly_token_budget=10)
    conn = await asyncpg.connect(database_url)
    try:  # the month's usage already at the budget
        await conn.execute(
            "INSERT INTO requests (request_id, model, tier, tenant_id, prompt_tokens, completion_tokens, "
            "finish_reason, queue_ms, total_ms, created_at) SELECT $1, 'tiny', 'pro', id, 5, 5, 'stop', 0, 0, now() "
            "FROM tenants WHERE name = $2", f"spent-{tenant}", tenant)
    finally:
        await conn.close()
    with OpenAI(base_url=f"{system}/v1", api_key=secret, max_retries=0) as client:
        _, spent = submit(client, [chat_line("x")])
        spent = await wait_batch(client, spent.id, finished, what="failed")
        assert spent.status == "failed" and spent.errors.data[0].code == "insufficient_quota", spent.errors
