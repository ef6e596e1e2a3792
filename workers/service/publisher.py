"""What a worker sends out: token deltas (core NATS), usage records and batch results (JetStream, durable)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from switchyard.shared import subjects
from switchyard.shared.jetstream import publish_once
from switchyard.shared.messages import (
    BatchChoice,
    BatchResult,
    ErrorInfo,
    GenerateRequest,
    TokenDelta,
    Usage,
    UsageRecord,
    add_tool_call_parts,
    encode,
)
from switchyard.workers.engine.prompts import PreparedPrompt

log = logging.getLogger("switchyard.worker")

# How long a usage record or batch result is retried through a NATS outage (a cluster electing a leader takes
# seconds, a restarted server about as long) before it is logged as lost. Deltas wait behind it meanwhile.
RECORD_RETRY_S = 30.0


@dataclass(slots=True)
class Tracked:
    """A request this worker has taken: its timings and counts so far, for its usage record."""

    request: GenerateRequest
    received_at: float
    admitted_at: float = 0.0
    first_token_at: float | None = None
    num_finished: int = 0
    prompt_tokens: int = 0
    dropped_messages: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    choices: dict[int, BatchChoice] = field(default_factory=dict)  # batch lines only: the text so far
    prepared: PreparedPrompt | None = None  # its prompt, tokenized at intake
    superseded: bool = False  # a gateway took this worker for dead and continued it elsewhere: not billed here
    trace_context: object | None = None  # the gateway's trace, from the message headers (shared/tracing.py)

    def collect(self, delta: TokenDelta) -> None:
        choice = self.choices.setdefault(delta.index, BatchChoice(delta.index))
        choice.text += delta.text
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        add_tool_call_parts(choice.tool_calls, delta.tool_calls)



def attempt_of(request: GenerateRequest) -> int:
    """Which run of ``request`` this is (its deltas say it, so a gateway tells a superseded run's apart)."""
    return 0 if request.resume is None else request.resume.attempt


class Publisher:
    """Publishes one worker's outputs; every method is safe to call whatever NATS is doing (errors are logged
    where a retry happens elsewhere)."""

    def __init__(self, nc, js, worker_id: str) -> None:
        self._nc = nc
        self._js = js
        self.worker_id = worker_id
        self._next_seq: dict[str, int] = {}  # per request still publishing: the seq its next delta gets

    async def delta(self, delta: TokenDelta) -> None:
        delta.seq = self._next_seq.get(delta.request_id, 0)
        delta.worker_id = self.worker_id
        self._next_seq[delta.request_id] = delta.seq + 1
        await self._nc.publish(subjects.token_subject(delta.request_id), encode(delta))

    async def error(self, request: GenerateRequest, error: ErrorInfo) -> None:
        """Answer ``request`` with ``error`` instead of running (or finishing) it."""
        await self.delta(TokenDelta(request.request_id, error=error, attempt=attempt_of(request)))
        self._next_seq.pop(request.request_id, None)
        if request.result_subject:
            await self.batch_result(request, BatchResult(request.request_id, self.worker_id, error=error))

    async def batch_result(self, request: GenerateRequest, result: BatchResult) -> None:
        try:
            if result.started:  # a hint for the batch runner, sent once per run: no retries, no dedup
                await self._js.publish(request.result_subject, encode(result))
            else:  # durable, and deduplicated by request id: a final result published twice is stored once
                await publish_once(self._js, request.result_subject, encode(result), request.request_id,
                                   within_s=RECORD_RETRY_S)
        except Exception:  # the batch runner re-publishes a line whose result never comes
            log.exception("could not publish the batch result of %s", request.request_id)

    async def finished(self, tracked: Tracked, finish_reason: str, now: float) -> None:
        """The usage record of a request whose every choice has ended, then (a batch line) its whole result.
        A superseded request gets neither: the worker that continued it bills every token and answers."""
        req = tracked.request
        self._next_seq.pop(req.request_id, None)  # its last delta is out
        if tracked.superseded:
            return
        record = UsageRecord(
            request_id=req.request_id,
            model=req.model,
            tier=req.tier,
            prompt_tokens=tracked.prompt_tokens,
            completion_tokens=tracked.completion_tokens,
            cached_tokens=tracked.cached_tokens,
            finish_reason=finish_reason,
            created_at=req.created_at,
            queue_ms=(tracked.admitted_at - req.created_at) * 1000,
            first_token_ms=None if tracked.first_token_at is None else (tracked.first_token_at - req.created_at) * 1000,
            total_ms=(now - req.created_at) * 1000,
            tenant_id=req.tenant_id,
            api_key_id=req.api_key_id,
            worker_id=self.worker_id,
            end_user=req.end_user,
            metadata=req.metadata,
        )
        try:
            await publish_once(self._js, subjects.USAGE_SUBJECT, encode(record), req.request_id,
                               within_s=RECORD_RETRY_S)
        except Exception:
            log.exception("could not record usage of %s", req.request_id)
        if req.result_subject:  # after the usage record: a line is never done but unbilled
            usage = Usage(tracked.prompt_tokens, tracked.completion_tokens, tracked.cached_tokens)
            choices = [tracked.choices[i] for i in sorted(tracked.choices)]
            await self.batch_result(req, BatchResult(req.request_id, self.worker_id, choices=choices,
                                                              usage=usage))

