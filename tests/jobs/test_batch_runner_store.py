"""The batch runner's storage of results in a real PostgreSQL: what a model writes reaches the output file as
written, U+0000 included (JSON allows it; jsonb and text columns do not), and a result Postgres refuses fails its
own line instead of holding back the others forever."""

from __future__ import annotations

import json
import secrets
from datetime import UTC, datetime, timedelta

import asyncpg

from switchyard.domain.tenancy import create_tenant
from switchyard.jobs.batch_runner import BatchRunner
from switchyard.shared.messages import BatchChoice, BatchResult, Usage


async def make_batch(pool, custom_ids: list[str], content: str = "hi") -> tuple[str, dict[str, str]]:
    """An in-progress batch whose lines are queued (published, waiting for results); returns (id, custom → request)."""
    batch_id, request_ids = f"batch_{secrets.token_hex(8)}", {}
    async with pool.acquire() as conn:
        tenant_id = await create_tenant(conn, f"t-{secrets.token_hex(4)}", "pro")
        await conn.execute(
            "INSERT INTO batches (id, tenant_id, input_file_id, endpoint, completion_window, status, in_progress_at, "
            "expires_at) VALUES ($1, $2, 'file-x', '/v1/chat/completions', '24h', 'in_progress', now(), $3)",
            batch_id, tenant_id, datetime.now(UTC) + timedelta(hours=24))
        for i, custom_id in enumerate(custom_ids, 1):
            request_ids[custom_id] = f"req-{secrets.token_hex(8)}"
            body = {"model": "m", "messages": [{"role": "user", "content": content}]}
            await conn.execute(
                "INSERT INTO batch_lines (batch_id, line_no, custom_id, body, request_id, status, queued_at) "
                "VALUES ($1, $2, $3, $4, $5, 'queued', now())", batch_id, i, custom_id, json.dumps(body),
                request_ids[custom_id])
    return batch_id, request_ids


def result(request_id: str, text: str) -> BatchResult:
    return BatchResult(request_id, "w1", choices=[BatchChoice(0, text, "length")], usage=Usage(3, 2, 0))


async def output_lines(pool, batch_id: str) -> dict[str, dict]:
    runner = BatchRunner(None, None, pool, None, "")
    await runner._tick()  # nothing pending or queued: the batch is finalized
    async with pool.acquire() as conn:
        batch = await conn.fetchrow("SELECT status, output_file_id, error_file_id FROM batches WHERE id = $1",
                                    batch_id)
        assert batch["status"] == "completed"
        lines = {}
        for file_id in (batch["output_file_id"], batch["error_file_id"]):
            if file_id:
                content = await conn.fetchval("SELECT content FROM files WHERE id = $1", file_id)
                lines.update({(x := json.loads(line))["custom_id"]: x for line in bytes(content).splitlines()})
        return lines


async def test_a_nul_character_in_the_prompt_and_in_the_reply_reaches_the_output_file(pool):
    batch_id, ids = await make_batch(pool, ["a", "b"], content="nul \u0000 in the prompt")
    runner = BatchRunner(None, None, pool, None, "")
    await runner._record([result(ids["a"], "x\u0000y"), result(ids["b"], "plain")])
    lines = await output_lines(pool, batch_id)
    assert lines["a"]["response"]["body"]["choices"][0]["message"]["content"] == "x\u0000y"
    assert lines["b"]["response"]["body"]["choices"][0]["message"]["content"] == "plain"


async def test_a_result_postgres_refuses_fails_only_its_own_line(pool, monkeypatch):
    batch_id, ids = await make_batch(pool, ["good", "bad"])
    runner = BatchRunner(None, None, pool, None, "")
    refuse = BatchRunner._record

    async def record(self, results):  # Postgres refusing one result, as it refused U+0000 in jsonb
        if any(r.choices and r.choices[0].text == "refused" for r in results):
            raise asyncpg.exceptions.UntranslatableCharacterError("unsupported Unicode escape sequence")
        await refuse(self, results)

    monkeypatch.setattr(BatchRunner, "_record", record)
    await runner._record_alone(result(ids["good"], "fine"))
    await runner._record_alone(result(ids["bad"], "refused"))
    monkeypatch.undo()
    lines = await output_lines(pool, batch_id)
    assert lines["good"]["response"]["status_code"] == 200
    assert lines["bad"]["response"]["status_code"] == 500
    assert "could not be stored" in lines["bad"]["response"]["body"]["error"]["message"]


async def test_a_batch_whose_lines_cannot_be_stored_fails_with_the_reason(pool, monkeypatch):
    """Once, such a batch stayed in ``validating``, its file read again every second for 24 hours."""
    from switchyard.domain.files import insert_file
    from switchyard.jobs.batch_store import BatchStore

    line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
    async with pool.acquire() as conn:
        tenant_id = await create_tenant(conn, f"t-{secrets.token_hex(4)}", "pro")
        file_id = (await insert_file(conn, tenant_id, "batch", "in.jsonl", json.dumps(line).encode()))["id"]
        batch = await conn.fetchrow(
            "INSERT INTO batches (id, tenant_id, input_file_id, endpoint, completion_window, expires_at) "
            "VALUES ($1, $2, $3, '/v1/chat/completions', '24h', now() + interval '1 day') RETURNING *",
            f"batch_{secrets.token_hex(8)}", tenant_id, file_id)

    async def refuse(conn, batch_id, lines):
        raise asyncpg.DataError("invalid byte sequence for encoding \"UTF8\": 0x00")

    monkeypatch.setattr(BatchStore, "add_lines", staticmethod(refuse))
    await BatchRunner(None, None, pool, None, "")._validate(batch)
    row = await pool.fetchrow("SELECT status, errors FROM batches WHERE id = $1", batch["id"])
    assert row["status"] == "failed"
    error = json.loads(row["errors"])["data"][0]
    assert error["code"] == "invalid_file" and "could not be stored" in error["message"], error
    assert await pool.fetchval("SELECT count(*) FROM batch_lines WHERE batch_id = $1", batch["id"]) == 0
