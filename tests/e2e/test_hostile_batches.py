"""Batches that cannot jam, tried as a hostile tenant would: a line the JSON parser gives up on, a file of empty
lines, a file too long, each fails its batch at once with the reason (never ``validating`` for 24 hours, read
again every second); and while one tenant's huge file is being read, another tenant's batch starts and
completes."""

from __future__ import annotations

import asyncio
import json

import pytest
from openai import OpenAI

from tests.support.system import poll

MODEL = "tiny"


def chat_line(custom_id: str, model: str = MODEL) -> bytes:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": model, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
        "ignore_eos": True}}).encode() + b"\n"


def submit(client: OpenAI, content: bytes):
    f = client.files.create(file=("input.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")


async def settled(client: OpenAI, batch_id: str, timeout_s: float = 60):
    return await poll(lambda: asyncio.to_thread(client.batches.retrieve, batch_id),
                      lambda b: b.status not in ("validating", "in_progress", "finalizing"), timeout_s,
                      interval_s=0.2, what=lambda b: f"batch {batch_id} still {b.status}")


@pytest.fixture
async def tenant(system, new_key):
    async def make() -> OpenAI:
        _, secret = await new_key("pro", rpm_limit=10**6, tpm_limit=10**9)
        return OpenAI(base_url=f"{system}/v1", api_key=secret, max_retries=0, timeout=120)
    return make


@pytest.mark.parametrize(("content", "code", "line"), [
    (chat_line("a") + b"[" * 20_000 + b"\n" + chat_line("b"), "invalid_json_line", 2),
    (b"\n" * 666_666, "empty_file", None),
    (b"".join(chat_line(f"id-{i}") for i in range(50_001)), "too_many_requests", None),
], ids=["nested-brackets", "empty-lines", "too-many-lines"])
async def test_a_file_that_cannot_run_fails_its_batch_at_once(tenant, content, code, line):
    client = await tenant()
    done = await settled(client, submit(client, content).id)
    assert done.status == "failed", done
    assert [(e.code, e.line) for e in done.errors.data][-1] == (code, line), done.errors


async def test_one_tenants_huge_file_does_not_hold_up_anothers_batch(tenant):
    """A's file: 50 000 lines naming a model nobody serves (read whole before it fails); B's small batch, sent
    just after, starts while A's is still being read, and completes."""
    a, b = await tenant(), await tenant()
    huge = submit(a, b"".join(chat_line(f"id-{i}", model="nobody-serves-this") for i in range(50_000)))
    small = submit(b, chat_line("x") + chat_line("y"))
    b_done = await settled(b, small.id, timeout_s=120)
    a_done = await settled(a, huge.id, timeout_s=180)
    assert b_done.status == "completed" and b_done.request_counts.completed == 2, b_done
    assert a_done.status == "failed" and a_done.errors.data[0].code == "model_not_found", a_done.errors
    assert b_done.in_progress_at <= a_done.failed_at, (b_done.in_progress_at, a_done.failed_at)
