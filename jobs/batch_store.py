"""Every SQL statement of the batch runner, each a method named for what it does to ``batches`` and ``batch_lines``.

Each state change is a guarded UPDATE (``... WHERE status = <the state it leaves>``), so a leader that died
half-way, or a second one racing it, changes nothing twice. What the runner decides from the rows (a line's
outcome, the result files) lives in the pure functions of ``domain.batch_format``.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable, Sequence

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from switchyard.domain.api.text import storable
from switchyard.domain.auth import AuthContext, tenant_context
from switchyard.domain.batch_format import ResultFiles
from switchyard.domain.files import insert_file
from switchyard.shared.messages import BatchResult
from switchyard.shared.tiers import BATCH_TIER

LOCK_KEY = 0x5359_4241_5443_4852  # "SYBATCHR": one leader across all gateways
INPUT_CHUNK_BYTES = 1 << 20  # an input file is read this much at a time


def as_json(value: dict | None) -> str | None:
    return None if value is None else json.dumps(value)


# -- leadership: a session-level advisory lock on a dedicated connection --------------------------------------
async def try_lead(conn: asyncpg.Connection) -> bool:
    return await conn.fetchval("SELECT pg_try_advisory_lock($1)", LOCK_KEY)


async def step_down(conn: asyncpg.Connection) -> None:
    await conn.execute("SELECT pg_advisory_unlock($1)", LOCK_KEY)


async def check_alive(conn: asyncpg.Connection) -> None:
    """Raises once the lock's connection is gone (and with it the lock)."""
    await conn.fetchval("SELECT 1")


# An outcome for a final result: (status, response, error) from the line's row and the result, or None to leave
# the line as it is.
Outcome = Callable[[asyncpg.Record, BatchResult], tuple[str, dict | None, dict | None] | None]


class BatchStore:
    """The batch tables, through one pool."""

    def __init__(self, pool: asyncpg.Pool) -> None:
        self._pool = pool

    # -- results ------------------------------------------------------------------------------------------------
    async def record_results(self, started: list[tuple[str, str | None]], finals: dict[str, BatchResult],
                             outcome: Outcome) -> None:
        """In one transaction: ``started`` (request id, worker id) marks queued lines taken; each final result
        whose line still waits for one gets ``outcome``. A line of a cancelling batch marked cancelled while a
        worker ran it to the end anyway is offered too: that result is kept (it ran and is billed)."""
        async with self._pool.acquire() as conn, conn.transaction():
            if started:
                await conn.executemany("UPDATE batch_lines SET worker_id = $2 WHERE request_id = $1 "
                                       "AND status = 'queued'", started)
            if not finals:
                return
            rows = await conn.fetch(
                "SELECT l.request_id, l.status, l.body, extract(epoch FROM l.queued_at) AS "
                "queued_at, b.endpoint, b.status AS batch_status FROM batch_lines l JOIN batches b "
                "ON b.id = l.batch_id WHERE l.request_id = ANY($1) AND (l.status = 'queued' OR "
                "(l.status = 'cancelled' AND b.status = 'cancelling'))", list(finals))
            updates = []
            for row in rows:
                decided = outcome(row, finals[row["request_id"]])
                if decided is not None:
                    status, response, error = decided
                    updates.append((row["request_id"], status, as_json(response), as_json(error), row["status"]))
            await conn.executemany(
                "UPDATE batch_lines SET status = $2, response = $3::json, error = $4::json, worker_id = NULL "
                "WHERE request_id = $1 AND status = $5", updates)

    # -- batches --------------------------------------------------------------------------------------------------
    async def unfinished_batches(self) -> list[asyncpg.Record]:
        return await self._pool.fetch("SELECT * FROM batches WHERE status IN ('validating', 'in_progress', "
                                      "'finalizing', 'cancelling') ORDER BY created_at")

    async def input_chunks(self, batch, chunk_bytes: int = INPUT_CHUNK_BYTES) -> AsyncIterator[bytes] | None:
        """The batch's input file in chunks, read a chunk at a time (a 50 MB file is never held whole); None when
        the file is gone."""
        where = "FROM files WHERE id = $1 AND tenant_id = $2 AND deleted_at IS NULL"
        size = await self._pool.fetchval(f"SELECT octet_length(content) {where}", batch["input_file_id"],
                                         batch["tenant_id"])
        if size is None:
            return None

        async def chunks() -> AsyncIterator[bytes]:
            for offset in range(0, size, chunk_bytes):
                yield bytes(await self._pool.fetchval(f"SELECT substring(content FROM $3 FOR $4) {where}",
                                                      batch["input_file_id"], batch["tenant_id"], offset + 1,
                                                      chunk_bytes))

        return chunks()

    @contextlib.asynccontextmanager
    async def starting(self) -> AsyncIterator[PoolConnectionProxy]:
        """A transaction for a batch about to start: its lines go in as they are validated (``add_lines``) and
        ``begin`` moves it to in_progress; an exception leaves nothing behind."""
        async with self._pool.acquire() as conn, conn.transaction():
            yield conn

    async def fail_validation(self, batch_id: str, errors: list[dict]) -> None:
        await self._pool.execute(
            "UPDATE batches SET status = 'failed', failed_at = now(), errors = $2::jsonb WHERE id = $1 "
            "AND status = 'validating'", batch_id, json.dumps({"object": "list", "data": storable(errors)}))

    @staticmethod
    async def add_lines(conn: asyncpg.Connection | PoolConnectionProxy, batch_id: str, lines: Sequence[tuple]) -> None:
        """Store ``lines`` (line_no, custom_id, body json, request_id, estimated tokens) of a batch starting."""
        if lines:
            await conn.copy_records_to_table(
                "batch_lines", columns=["batch_id", "line_no", "custom_id", "body", "request_id", "estimated_tokens"],
                records=[(batch_id, *line) for line in lines])

    @staticmethod
    async def begin(conn: asyncpg.Connection | PoolConnectionProxy, batch_id: str, model: str | None) -> bool:
        """validating → in_progress; False when the batch left validating meanwhile (cancelled while it was read)."""
        status = await conn.execute(
            "UPDATE batches SET status = 'in_progress', in_progress_at = now(), model = $2 WHERE id = $1 "
            "AND status = 'validating'", batch_id, model)
        return not status.endswith(" 0")

    async def begin_finalizing(self, batch_id: str) -> bool:
        """in_progress → finalizing; False when another state won."""
        status = await self._pool.execute("UPDATE batches SET status = 'finalizing', finalizing_at = now() "
                                          "WHERE id = $1 AND status = 'in_progress'", batch_id)
        return not status.endswith(" 0")

    async def finish(self, batch, final: str, from_status: str, files: ResultFiles) -> bool:
        """Store the output and error files and move the batch to ``final``, in one transaction, if it is still
        ``from_status``."""
        batch_id = batch["id"]
        async with self._pool.acquire() as conn, conn.transaction():
            if await conn.fetchval("SELECT status FROM batches WHERE id = $1 FOR UPDATE", batch_id) != from_status:
                return False
            output_id = error_id = None
            if files.output:
                output_id = (await insert_file(conn, batch["tenant_id"], "batch_output", f"{batch_id}_output.jsonl",
                                               bytes(files.output)))["id"]
            if files.errors:
                error_id = (await insert_file(conn, batch["tenant_id"], "batch_output", f"{batch_id}_error.jsonl",
                                              bytes(files.errors)))["id"]
            await conn.execute(
                f"UPDATE batches SET status = $2, {final}_at = now(), output_file_id = $3, error_file_id = $4, "
                "request_counts = $5::jsonb, usage = $6::jsonb WHERE id = $1", batch_id, final, output_id, error_id,
                json.dumps(files.counts), json.dumps(files.usage))
        return True

    # -- lines ----------------------------------------------------------------------------------------------------
    # -- limits -------------------------------------------------------------------------------------------------
    async def tenant(self, batch) -> AuthContext:
        """What admission judges the batch's lines by: its tenant as it is now, under the key that created the
        batch; a tenant that cannot be read gets the deployment's defaults."""
        auth = await tenant_context(self._pool, batch["tenant_id"], batch["api_key_id"])
        return auth or AuthContext(batch["tenant_id"], "", batch["api_key_id"], BATCH_TIER, None, None, None)

    async def count_waiting(self, batch_id: str) -> tuple[int, int]:
        """(pending, queued) lines of a batch."""
        counts = {r["status"]: r["n"] for r in await self._pool.fetch(
            "SELECT status, count(*) AS n FROM batch_lines WHERE batch_id = $1 AND status IN ('pending', 'queued') "
            "GROUP BY status", batch_id)}
        return counts.get("pending", 0), counts.get("queued", 0)

    async def pending_lines(self, batch_id: str, limit: int) -> list[asyncpg.Record]:
        return await self._pool.fetch(
            "SELECT custom_id, body, request_id, attempts FROM batch_lines WHERE batch_id = $1 "
            "AND status = 'pending' ORDER BY line_no LIMIT $2", batch_id, limit)

    async def mark_published(self, published: list[tuple[str, int, str]], failed: list[tuple[str, str]]) -> None:
        """``published`` (request id, stream seq, status it left) are queued now; ``failed`` (request id,
        response json) could not be."""
        async with self._pool.acquire() as conn, conn.transaction():
            await conn.executemany(
                "UPDATE batch_lines SET status = 'queued', stream_seq = $2, queued_at = now(), "
                "worker_id = NULL, attempts = attempts + 1 WHERE request_id = $1 AND status = $3", published)
            await conn.executemany("UPDATE batch_lines SET status = 'failed', response = $2::json "
                                   "WHERE request_id = $1", failed)

    async def queued_lines(self, batch_id: str) -> list[asyncpg.Record]:
        return await self._pool.fetch("SELECT request_id, stream_seq FROM batch_lines WHERE batch_id = $1 "
                                      "AND status = 'queued' ORDER BY stream_seq", batch_id)

    async def cancel_queued(self, lines: list[tuple[str, str]]) -> None:
        """(request id, error json) of queued lines to cancel."""
        await self._pool.executemany("UPDATE batch_lines SET status = 'cancelled', error = $2::json "
                                     "WHERE request_id = $1 AND status = 'queued'", lines)

    async def cancel_pending(self, batch_id: str, error: str) -> None:
        await self._pool.execute("UPDATE batch_lines SET status = 'cancelled', error = $2::json WHERE batch_id = $1 "
                                 "AND status = 'pending'", batch_id, error)

    async def all_lines(self, batch_id: str) -> list[asyncpg.Record]:
        return await self._pool.fetch("SELECT custom_id, request_id, status, response, error FROM batch_lines "
                                      "WHERE batch_id = $1 ORDER BY line_no", batch_id)

    async def maybe_lost_lines(self, stale_s: float) -> list[asyncpg.Record]:
        """Queued lines of live batches that a worker said it took, or that were queued over ``stale_s`` ago."""
        return await self._pool.fetch(
            "SELECT l.custom_id, l.body, l.request_id, l.attempts, l.stream_seq, l.worker_id, b.id, b.status, "
            "b.endpoint, b.tenant_id, b.api_key_id, b.expires_at FROM batch_lines l JOIN batches b "
            "ON b.id = l.batch_id WHERE l.status = 'queued' AND b.status IN ('in_progress', 'cancelling') "
            "AND (l.worker_id IS NOT NULL OR l.queued_at < now() - make_interval(secs => $1))", stale_s)

    async def still_queued(self, request_id: str) -> None:
        """The line is still in the queue: its staleness counts from now."""
        await self._pool.execute("UPDATE batch_lines SET queued_at = now() WHERE request_id = $1", request_id)
