"""A running batch's lines in and out of the batch tier's queue, for the batch runner (jobs/batch_runner.py).

    pending line ─▶ admission (domain/admission: budget, input filter, ... as any request) ─▶ refused: failed alone
                ─▶ publish (domain/publish.py) ─▶ too large: failed alone; queue at its cap: waits, in Postgres
                ─▶ queued (its stream sequence recorded)
    queued line  ─▶ cancel/expire: its message deleted from the stream by sequence, or, once a worker took it,
                    llm.cancel.<id>

Every publish of a line carries a message id derived from its request id, so a leader that died before recording
a publish, publishing it again, queues it once.
"""

from __future__ import annotations

import asyncio
import json
import time

from nats.js import JetStreamContext
from nats.js.errors import APIError, NotFoundError
from pydantic import ValidationError

from switchyard.domain.admission.pipeline import Pipeline
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.auth import AuthContext
from switchyard.domain.batch_format import error_response, parse_body, wire_request
from switchyard.domain.errors import OpenAIError
from switchyard.domain.publish import QueueFull, QueueUnavailable, RequestPublisher
from switchyard.jobs.batch_store import BatchStore
from switchyard.shared import subjects
from switchyard.shared.messages import ErrorInfo
from switchyard.shared.tiers import BATCH_TIER

ERR_NO_MESSAGE = 10057  # JetStream: no message at that sequence (taken by a worker, or deleted already)
_BATCH_STREAM = subjects.request_stream(BATCH_TIER)
# A batch line's publish may wait this long for JetStream (a leader election); the tick after retries it.
PUBLISH_WITHIN_S = 5.0
RETRY_AFTER_S = 5  # a batch line's 503 is never a client's: only the answer's shape needs it


class LineQueue:
    def __init__(self, nc, js: JetStreamContext, store: BatchStore, admission: Pipeline | None) -> None:
        """``admission``: what each line passes before it is queued (None: nothing)."""
        self._nc = nc
        self._js = js
        self._store = store
        self._admission = admission
        self._publisher = RequestPublisher(nc, js, RETRY_AFTER_S)

    async def publish(self, batch, lines, from_status: str) -> tuple[int, bool]:
        """Publish ``lines`` of ``batch`` (stopping at a full queue) and record where each one sits in the stream,
        or why it failed; returns (how many were queued, whether the queue was full)."""
        published, failed, full = [], [], False
        auth = await self._store.tenant(batch) if self._admission is not None else None
        try:
            for line in lines:
                try:
                    seq = await self._publish(batch, line, auth)
                except QueueFull:
                    full = True
                    break  # the batch queue is at its cap: the rest waits for the next tick
                except QueueUnavailable:
                    raise  # NATS away: the next tick tries again
                except (ValidationError, OpenAIError) as exc:  # refused or too large: this line alone fails
                    error = exc.info() if isinstance(exc, OpenAIError) else ErrorInfo(
                        f"Invalid request body: {exc.errors()[0].get('msg')}.", code="invalid_request")
                    failed.append((line["request_id"], json.dumps(error_response(line["request_id"], error))))
                    continue
                published.append((line["request_id"], seq, from_status))
        finally:
            if published or failed:
                await self._store.mark_published(published, failed)
        return len(published), full

    async def _publish(self, batch, line, auth: AuthContext | None) -> int:
        """Admit and publish one line; returns its stream sequence."""
        # Validated when the batch started: only a changed schema fails here.
        parsed = parse_body(batch["endpoint"], json.loads(line["body"]))
        request = wire_request(
            batch["endpoint"], parsed, line["request_id"], tenant_id=batch["tenant_id"],
            api_key_id=batch["api_key_id"], created_at=time.time(), deadline_at=batch["expires_at"].timestamp(),
            result_subject=subjects.result_subject(batch["id"]), tier=BATCH_TIER)
        if self._admission is not None:  # judged as an interactive request is, when it would be queued
            assert auth is not None  # the caller reads the tenant whenever there is admission
            ticket = await self._admission.check(Ticket.for_body(Origin.BATCH_LINE, auth, request.request_id, parsed))
            request.safety = ticket.safety
        # The first publish is deduplicated by the request id itself (a leader that died before recording it
        # publishes it again); a deliberate re-publish needs a new message id, or JetStream would drop it.
        attempts = line["attempts"]
        msg_id = request.request_id if attempts == 0 else f"{request.request_id}.{attempts}"
        return await self._publisher.publish(request, msg_id=msg_id, within_s=PUBLISH_WITHIN_S)

    async def stop_queued(self, batch_id: str, error: str, wait: bool) -> int:
        """Take a batch's queued lines back: delete the messages still in the queue, cancel the running ones.

        Returns how many still run (their results come back as cancelled); with ``wait`` false they are marked
        stopped now and a late result is ignored.
        """
        lines = await self._store.queued_lines(batch_id)
        # Cancels first: a running line stops, and a worker that fetched a message just before its delete
        # remembers the cancel and refuses the request when it arrives. Then the deletes, front of the queue
        # first and concurrently, since workers keep pulling meanwhile.
        for line in lines:
            await self._nc.publish(subjects.cancel_subject(line["request_id"]), b"")
        await self._nc.flush()
        deleted = []
        for i in range(0, len(lines), 64):
            deleted += await asyncio.gather(*(self._unqueue(line["stream_seq"]) for line in lines[i:i + 64]))
        unqueued = [(line["request_id"], error) for line, gone in zip(lines, deleted) if gone or not wait]
        await self._store.cancel_queued(unqueued)
        return len(lines) - len(unqueued)

    async def _unqueue(self, seq: int) -> bool:
        """Delete a line's message if it still waits in the queue; False once a worker has taken it."""
        try:
            return await self._js.delete_msg(_BATCH_STREAM, seq)
        except APIError as exc:
            if is_gone(exc):
                return False
            raise

    async def is_waiting(self, seq: int) -> bool:
        """Whether the line at ``seq`` still waits in the queue (no worker took it yet)."""
        try:
            await self._js.get_msg(_BATCH_STREAM, seq)
            return True
        except APIError as exc:
            if is_gone(exc):
                return False
            raise


def is_gone(exc: APIError) -> bool:
    """JetStream has no message at that sequence: a worker took it, or it was deleted already."""
    return isinstance(exc, NotFoundError) or exc.err_code == ERR_NO_MESSAGE
