"""A request's part of its trace on the worker: its time in the queue, its prefill and its decode, as children of
the gateway's span (the trace context came in the request message's headers), recorded when the request ends."""

from __future__ import annotations

from switchyard.shared.tracing import child_context, record_span
from switchyard.workers.service.held import Tracked


def record_request_trace(tracked: Tracked, worker_id: str, finish_reason: str, ended_at: float) -> None:
    """Spans ``queue`` (gateway accept → this worker starting it), ``generate`` (start → end) and inside it
    ``prefill`` (start → first token) and ``decode`` (first token → end). Nothing when the request came untraced."""
    if tracked.trace_context is None:
        return
    req = tracked.request
    started = tracked.admitted_at or tracked.received_at
    record_span("queue", tracked.trace_context, req.created_at, started, tier=req.tier, model=req.model)
    generate = record_span("generate", tracked.trace_context, started, ended_at, worker_id=worker_id,
                           tier=req.tier, model=req.model, prompt_tokens=tracked.prompt_tokens,
                           completion_tokens=tracked.completion_tokens, cached_tokens=tracked.cached_tokens,
                           finish_reason=finish_reason)
    inside = child_context(generate)
    first = tracked.first_token_at or ended_at
    record_span("prefill", inside, started, first, prompt_tokens=tracked.prompt_tokens)
    record_span("decode", inside, first, ended_at, completion_tokens=tracked.completion_tokens)
