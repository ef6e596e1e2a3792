"""Runs batches: every copy of the jobs (``switchyard jobs``, or a gateway run with them) starts one
``BatchRunner``; the one holding a Postgres advisory lock leads.

    leader loop (one process; the others retry the lock every LEAD_RETRY_S)
      consume BATCH_RESULTS ── started marker: line.worker_id ─┐   final result: line completed / failed,
      (durable pull consumer)   (UPDATE … WHERE status='queued', then ack: a redelivered result changes nothing)
      tick, every TICK_S, per unfinished batch:
        validating  ─ in a task of its own (MAX_VALIDATING at once, one per tenant): the input file read and
                      its lines stored a chunk at a time, models live, admission of the batch (budget, enqueued
                      tokens) ─▶ failed (errors with line numbers, or why it cannot be stored) | in_progress
        in_progress ─ admit and publish pending lines on llm.req.<model>.batch (≤ MAX_IN_FLIGHT queued per
                      batch; a full batch queue just waits; jobs/batch_lines.py)
                      ─ none pending or queued ─▶ finalizing ─▶ completed
        cancelling  ─ pending lines cancelled; queued messages deleted from the stream by seq, running ones
                      get llm.cancel.<id> ─ none queued ─▶ cancelled
        past expires_at ─▶ expired (finished lines kept, the rest cancelled without waiting)
      every CHECK_EVERY_S: a queued line whose worker vanished from the heartbeats (or that left the queue
        with no worker ever saying it took it) is published again, with the same request id

Every state change is a guarded UPDATE in Postgres and every publish carries a message id derived from the
line's request id, so a leader may die anywhere and the next one resumes; a line that runs twice (a re-publish
racing a slow worker) is billed once, because the usage writer inserts once per request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import asyncpg
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js.errors import APIError

from switchyard.domain.admission.pipeline import Pipeline
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.batch_format import CANCELLED, EXPIRED, ResultFiles, line_outcome, request_id_for
from switchyard.domain.batch_input import InputLine, LineParser, error_entry
from switchyard.domain.database import OUTAGE_ERRORS
from switchyard.domain.errors import OpenAIError, model_not_found
from switchyard.domain.publish import QueueUnavailable
from switchyard.domain.registry import ModelRegistry
from switchyard.jobs import batch_store
from switchyard.jobs.batch_lines import LineQueue
from switchyard.jobs.batch_store import BatchStore
from switchyard.jobs.consumer import consume_once
from switchyard.shared import subjects
from switchyard.shared.config import RequestLimits
from switchyard.shared.jetstream import ensure_batch_results_consumer
from switchyard.shared.messages import BatchResult, ErrorInfo

log = logging.getLogger("switchyard.batch")

LEAD_RETRY_S = 3.0
TICK_S = 1.0
MAX_IN_FLIGHT = 256  # lines of one batch queued or running at once: the rest wait in Postgres
CHECK_EVERY_S = 5.0
WORKER_GONE_S = 4.0  # missing from the heartbeats (already a 10 s TTL) in two checks this far apart
STALE_S = 120.0  # left the queue, and no worker said it took it: published again
CANCEL_GRACE_S = 60.0  # a cancelling batch stops waiting for its running lines after this
RESULTS_FETCH = 256
MAX_VALIDATING = 2  # batches read at once, at most one per tenant: one tenant's huge files never hold up another's
_CANCELLED = json.dumps(CANCELLED)
_EXPIRED = json.dumps(EXPIRED)


class BatchRunner:
    def __init__(self, nc, js: JetStreamContext, pool: asyncpg.Pool, registry: ModelRegistry,
                 database_url: str, admission: Pipeline | None = None, limits: RequestLimits | None = None) -> None:
        """``admission``: what a batch passes before it starts and each line before it is queued (None: nothing).
        ``limits``: what each line may ask for (the gateway's, domain/api/bounds.py)."""
        self._limits = limits or RequestLimits()
        self._validating: dict[str, tuple[str, asyncio.Task]] = {}  # batch id -> (tenant id, its validation)
        self._js = js
        self._store = BatchStore(pool)
        self._admission = admission
        self._lines = LineQueue(nc, js, self._store, admission)
        self._registry = registry
        self._database_url = database_url
        self._missing_since: dict[str, float] = {}  # worker id → when first seen missing

    # -- leadership -----------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Until ``stop``: lead while this process holds the lock; otherwise try again every LEAD_RETRY_S.

        The lock lives on a dedicated connection: if that connection drops, Postgres releases the lock and another
        process takes over, and this one steps down as soon as its next liveness query fails.
        """
        conn: asyncpg.Connection | None = None
        try:
            while not stop.is_set():
                try:
                    if conn is None or conn.is_closed():
                        conn = await asyncpg.connect(self._database_url)
                    if await batch_store.try_lead(conn):
                        log.info("this process now runs batches")
                        await self._lead(conn, stop)
                        with contextlib.suppress(Exception):
                            await batch_store.step_down(conn)
                except Exception as exc:  # Postgres or NATS away: step down, try again
                    log.warning("batch runner stepped down: %s", exc)
                    if conn is not None:
                        with contextlib.suppress(Exception):
                            await conn.close()
                    conn = None
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=LEAD_RETRY_S)
        finally:
            if conn is not None:
                with contextlib.suppress(Exception):
                    await conn.close()

    async def _lead(self, lock_conn: asyncpg.Connection, stop: asyncio.Event) -> None:
        await ensure_batch_results_consumer(self._js)
        sub = await self._js.pull_subscribe_bind(subjects.BATCH_RESULTS_CONSUMER,
                                                 stream=subjects.BATCH_RESULTS_STREAM)
        next_tick = next_check = time.monotonic()
        try:
            while not stop.is_set():
                await self._consume(sub)
                now = time.monotonic()
                if now >= next_tick:
                    await batch_store.check_alive(lock_conn)
                    await self._tick()
                    next_tick = now + TICK_S
                if now >= next_check:
                    try:
                        await self._check_lost()
                    except (TimeoutError, OSError, asyncpg.PostgresError, APIError, NatsTimeoutError) as exc:
                        log.warning("looking for lost batch lines failed: %s", exc)
                    next_check = now + CHECK_EVERY_S
        finally:
            for _, task in list(self._validating.values()):  # stepping down: the next leader reads them again
                task.cancel()
            with contextlib.suppress(Exception):
                await sub.unsubscribe()

    # -- results --------------------------------------------------------------------------------------------
    async def _consume(self, sub) -> None:
        await consume_once(self._js, sub, BatchResult, self._record_all, "batch result", RESULTS_FETCH, timeout_s=0.5)

    async def _record_all(self, results: list[BatchResult]) -> None:
        try:
            await self._record(results)
        except asyncpg.DataError as exc:  # one result Postgres refuses must not hold back the others forever
            log.error("could not record %d batch results together (%s); recording them one by one", len(results), exc)
            for result in results:
                await self._record_alone(result)

    async def _record_alone(self, result: BatchResult) -> None:
        """Record one result; one that Postgres still refuses fails its line with the reason instead."""
        try:
            await self._record([result])
        except asyncpg.DataError as exc:
            log.error("batch line %s: its result cannot be stored (%s); the line fails", result.request_id, exc)
            await self._record([BatchResult(result.request_id, result.worker_id, usage=result.usage, error=ErrorInfo(
                f"The result could not be stored: {exc}", code="internal_error", type="server_error", status=500))])

    async def _record(self, results: list[BatchResult]) -> None:
        started = [(r.request_id, r.worker_id) for r in results if r.started]
        finals = {r.request_id: r for r in results if not r.started}
        await self._store.record_results(started, finals, _outcome)

    # -- the tick -------------------------------------------------------------------------------------------
    async def _tick(self) -> None:
        rows = await self._store.unfinished_batches()
        now = time.time()
        for batch in rows:
            status = batch["status"]
            try:
                if status in ("validating", "in_progress") and now > batch["expires_at"].timestamp():
                    await self._expire(batch)
                elif status == "validating":
                    self._start_validation(batch)
                elif status == "in_progress":
                    await self._advance(batch)
                elif status == "cancelling":
                    await self._cancel(batch)
                else:
                    await self._finalize(batch, "completed", "finalizing")
            except (TimeoutError, OSError, asyncpg.PostgresError, APIError, NatsTimeoutError, QueueUnavailable) as exc:
                log.warning("batch %s (%s): %s; retrying next tick", batch["id"], status, exc)
            except Exception:  # a bug must not stop the other batches (nor this process's leadership)
                log.exception("batch %s (%s) failed a step; retrying next tick", batch["id"], status)

    def _start_validation(self, batch) -> None:
        """Validate ``batch`` in a task of its own, if a slot is free and its tenant has none running: a big file
        takes seconds to read, and every other batch, of every tenant, goes on meanwhile."""
        if batch["id"] in self._validating or len(self._validating) >= MAX_VALIDATING:
            return
        if any(tenant == batch["tenant_id"] for tenant, _ in self._validating.values()):
            return
        task = asyncio.create_task(self._validate(batch))
        self._validating[batch["id"]] = (batch["tenant_id"], task)
        task.add_done_callback(lambda _: self._validating.pop(batch["id"], None))

    async def _validate(self, batch) -> None:
        """Read the input file a chunk at a time, storing valid lines as they come (in one transaction); then the
        models, then admission (budget, enqueued tokens). Any refusal fails the batch with its reasons, a file that
        cannot be stored as well (never retried for ever); an outage is retried next tick."""
        batch_id = batch["id"]
        try:
            errors = await self._read_and_start(batch)
        except _Stopped:
            return
        except asyncio.CancelledError:
            raise
        except (TimeoutError, OSError, APIError, NatsTimeoutError, *OUTAGE_ERRORS) as exc:
            log.warning("batch %s (validating): %r; retrying next tick", batch_id, exc)
            return
        except Exception as exc:  # Postgres refused what the file holds, or a bug: the batch fails with why
            log.exception("batch %s could not be started", batch_id)
            errors = [error_entry(None, "invalid_file", f"The input file could not be stored: {exc}")]
        if errors:
            await self._store.fail_validation(batch_id, errors)
            log.info("batch %s failed validation (%d errors)", batch_id, len(errors))

    async def _read_and_start(self, batch) -> list[dict]:
        """The errors that fail the batch, or none once it started."""
        batch_id = batch["id"]
        chunks = await self._store.input_chunks(batch)
        if chunks is None:
            return [error_entry(None, "invalid_file", "The input file does not exist any more.", "input_file_id")]
        parser = LineParser(batch["endpoint"], self._limits)
        try:
            await self._store_lines(batch, chunks, parser)
        except _Refused as refused:  # the lines stored so far went with the transaction
            return refused.errors
        log.info("batch %s in progress: %d lines", batch_id, parser.num_lines)
        return []

    async def _store_lines(self, batch, chunks, parser: LineParser) -> None:
        """In one transaction: each chunk's valid lines stored as they come, then the batch started, or
        ``_Refused`` with the errors (nothing kept) or ``_Stopped`` (it was cancelled meanwhile)."""
        batch_id = batch["id"]
        async with self._store.starting() as conn:
            async for chunk in chunks:  # parsing 50k lines takes a while: off the event loop, a chunk at a time
                await self._store.add_lines(conn, batch_id, self._records(batch_id, await asyncio.to_thread(
                    parser.feed, chunk)))
                if parser.done:
                    break
            await self._store.add_lines(conn, batch_id, self._records(batch_id, parser.finish()))
            errors = parser.errors or await self._model_errors(parser.models)
            errors = errors or await self._refusal(batch, parser.estimated_tokens)
            if errors:
                raise _Refused(errors)
            models = set(parser.models)
            if not await self._store.begin(conn, batch_id, models.pop() if len(models) == 1 else None):
                raise _Stopped

    @staticmethod
    def _records(batch_id: str, lines: list[InputLine]) -> list[tuple]:
        return [(line.line_no, line.custom_id, line.body_json, request_id_for(batch_id, line.custom_id),
                 line.estimated_tokens) for line in lines]

    async def _model_errors(self, models: dict[str, int]) -> list[dict]:
        served = await self._registry.models(fresh=True)
        return [error_entry(n, "model_not_found", model_not_found(m).message, "body.model")
                for m, n in models.items() if m not in served]

    async def _refusal(self, batch, estimated_tokens: int) -> list[dict]:
        """Why admission refuses a batch of ``estimated_tokens`` about to start (its tenant's monthly budget spent,
        or its batches in progress holding too many tokens), as the batch's errors; none when it may start."""
        if self._admission is None:
            return []
        ticket = Ticket(Origin.BATCH, await self._store.tenant(batch), batch["id"], batch["model"] or "",
                        estimated_tokens=estimated_tokens)
        try:
            await self._admission.check(ticket)
        except OpenAIError as exc:
            return [{"code": exc.code, "line": None, "param": None, "message": exc.message}]
        return []

    async def _advance(self, batch) -> None:
        pending, queued = await self._store.count_waiting(batch["id"])
        if not pending and not queued:
            await self._finalize(batch, "completed", "in_progress")
            return
        while pending and queued < MAX_IN_FLIGHT:
            lines = await self._store.pending_lines(batch["id"], MAX_IN_FLIGHT - queued)
            if not lines:
                return
            published, full = await self._lines.publish(batch, lines, "pending")
            if published or full:
                return  # the rest waits for the next tick
            # Every one refused (the tenant's budget ran out while the batch ran): the next ones are judged now,
            # so a spent batch fails its lines in one tick rather than MAX_IN_FLIGHT a tick.
            pending -= len(lines)

    # -- stopping -------------------------------------------------------------------------------------------
    async def _cancel(self, batch) -> None:
        await self._store.cancel_pending(batch["id"], _CANCELLED)
        waited = time.time() - batch["cancelling_at"].timestamp()
        if await self._lines.stop_queued(batch["id"], _CANCELLED, wait=waited < CANCEL_GRACE_S) == 0:
            await self._finalize(batch, "cancelled", "cancelling")

    async def _expire(self, batch) -> None:
        await self._store.cancel_pending(batch["id"], _EXPIRED)
        await self._lines.stop_queued(batch["id"], _EXPIRED, wait=False)
        await self._finalize(batch, "expired", batch["status"])

    # -- the end --------------------------------------------------------------------------------------------
    async def _finalize(self, batch, final: str, from_status: str) -> None:
        """Write the output and error files and move to ``final``, if the batch is still ``from_status``."""
        batch_id = batch["id"]
        if final == "completed" and from_status == "in_progress":
            if not await self._store.begin_finalizing(batch_id):
                return
            from_status = "finalizing"
        files = ResultFiles()
        for row in await self._store.all_lines(batch_id):
            files.add(row["custom_id"], row["request_id"], row["status"],
                      json.loads(row["response"]) if row["response"] else None,
                      json.loads(row["error"]) if row["error"] else None)
        if await self._store.finish(batch, final, from_status, files):
            log.info("batch %s %s: %s", batch_id, final, files.counts)

    # -- lost lines -----------------------------------------------------------------------------------------
    async def _check_lost(self) -> None:
        """Publish again the queued lines no worker will ever answer: their worker died after taking them (its
        heartbeat is gone), or they left the queue long ago without any worker saying it took them."""
        served = await self._registry.models(fresh=True)
        live = {w.worker_id for workers in served.values() for w in workers}
        now = time.monotonic()
        for worker_id in [w for w in self._missing_since if w in live or now - self._missing_since[w] > 3600]:
            del self._missing_since[worker_id]
        rows = await self._store.maybe_lost_lines(STALE_S)
        lost = []
        for row in rows:
            if row["worker_id"] is not None:
                if row["worker_id"] in live:
                    continue
                if now - self._missing_since.setdefault(row["worker_id"], now) < WORKER_GONE_S:
                    continue
            elif await self._lines.is_waiting(row["stream_seq"]):
                await self._store.still_queued(row["request_id"])
                continue  # still waiting its turn in the queue: look again in STALE_S
            lost.append(row)
        for row in lost:
            log.warning("batch %s: line %s was lost (worker %s); publishing it again", row["id"], row["custom_id"],
                        row["worker_id"] or "unknown")
            if row["status"] == "cancelling":
                await self._store.cancel_queued([(row["request_id"], _CANCELLED)])
            else:
                await self._lines.publish(row, [row], "queued")


class _Refused(Exception):
    """A batch that may not start, with the errors that fail it."""

    def __init__(self, errors: list[dict]) -> None:
        super().__init__(f"{len(errors)} errors")
        self.errors = errors


class _Stopped(Exception):
    """A batch that left validating while it was read (cancelled): nothing to do."""


def _outcome(row, result: BatchResult) -> tuple[str, dict | None, dict | None] | None:
    """A final result's effect on its line: the line's outcome, unless the line was already cancelled (its batch
    is cancelling) and the result is not a completion worth keeping."""
    # The model is read here, not with ->> in SQL: Postgres cannot turn a U+0000 elsewhere in the body into text,
    # and refuses the whole query.
    model = json.loads(row["body"]).get("model")
    status, response, error = line_outcome(row["endpoint"], row["request_id"], model, float(row["queued_at"] or 0),
                                           row["batch_status"], result)
    if row["status"] == "queued" or status == "completed":
        return status, response, error
    return None
