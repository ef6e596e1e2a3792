"""Putting a request into its JetStream queue: one way for the gateway's requests, their continuations and offers,
and the batch runner's lines.

    encode ─▶ too large for one NATS message?  413 request_too_large (a batch fails that line alone)
           ─▶ publish with a message id (JetStream drops a second copy), retried through a leader election
           ─▶ the queue at its cap?             QueueFull, 429 queue_full ("Your": the tenant's own queue)
              the queue unavailable?            503, to retry

Which subject and which message id are the caller's: a request's id, an offer's ``<id>.offer``, a continuation's
``<id>.resume<n>``, a batch line published again ``<id>.<attempt>``.
"""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.errors import APIError

from switchyard.domain.errors import OpenAIError, service_unavailable
from switchyard.shared import subjects
from switchyard.shared.jetstream import QUEUE_FULL_CODES, is_transient, oversize_error, publish_once
from switchyard.shared.messages import GenerateRequest, encode
from switchyard.shared.stream_config import is_subject_cap
from switchyard.shared.tracing import inject_headers, tracer

PUBLISH_RETRY_S = 15.0  # a JetStream cluster elects a new stream leader within about 4 s of losing a node


class QueueFull(OpenAIError):
    """The request's queue is at its cap (the tier's, or the tenant's own in it): 429 ``queue_full``."""


class QueueUnavailable(OpenAIError):
    """JetStream did not take the request (unreachable, no leader yet): 503, to retry."""


def _unavailable(message: str, retry_after_s: int) -> QueueUnavailable:
    error = service_unavailable(message, retry_after_s)
    return QueueUnavailable(error.status, error.message, type=error.type, code=error.code, headers=error.headers)


class RequestPublisher:
    """Publishes requests; one per process, shared by every caller."""

    def __init__(self, nc: NATS, js: JetStreamContext, retry_after_s: int) -> None:
        self._nc = nc
        self._js = js
        self._retry_after_s = retry_after_s

    def encode(self, request: GenerateRequest) -> bytes:
        """The request as it is queued; raises OpenAIError 413 ``request_too_large`` when it does not fit."""
        payload = encode(request)
        too_large = oversize_error(self._nc, payload)
        if too_large is not None:
            raise OpenAIError.from_info(too_large)
        return payload

    async def publish(self, request: GenerateRequest, payload: bytes | None = None, *, subject: str | None = None,
                      msg_id: str | None = None, within_s: float = PUBLISH_RETRY_S) -> int:
        """Queue ``request`` (``payload``: its encoding, when the caller has it) on ``subject`` (default: its
        tenant's queue of its model and tier) with ``msg_id`` (default: its request id); returns its stream
        sequence. Raises QueueFull (429), QueueUnavailable (503) or OpenAIError 413."""
        payload = self.encode(request) if payload is None else payload
        queue = subjects.prefill_queue(request.model) if request.handover else request.model
        subject = subject or subjects.request_subject(queue, request.tier, request.tenant_id)
        if not self._nc.is_connected:
            # No server at all (not a leader election, which a connected client rides out by retrying): the
            # client hears "retry" now rather than after the whole retry window (tests/e2e/test_nats_restart.py).
            raise _unavailable("The request queue is unavailable right now; please retry.", self._retry_after_s)
        try:
            # Retried through a JetStream leader election (a cluster node lost); the message id keeps a retried
            # request from being queued twice.
            with tracer.start_as_current_span("publish", attributes={"request_id": request.request_id,
                                                                     "tier": request.tier}):
                ack = await publish_once(self._js, subject, payload, msg_id or request.request_id,
                                         within_s=within_s, headers=inject_headers())
        except APIError as exc:
            if exc.err_code in QUEUE_FULL_CODES:
                whose = "Your" if is_subject_cap(exc) else "The"
                raise QueueFull(429, f"{whose} {request.tier} tier queue for model `{request.model}` is full; "
                                "please retry later.", type="rate_limit_error", code="queue_full",
                                headers={"Retry-After": str(self._retry_after_s)}) from None
            if exc.code == 503:
                raise _unavailable("The request queue is unavailable right now; please retry.",
                                   self._retry_after_s) from None
            raise
        except Exception as exc:
            if not is_transient(exc):
                raise
            raise _unavailable("The request queue did not answer; please retry.", self._retry_after_s) from None
        return ack.seq

    async def count_refusal(self, request: GenerateRequest) -> None:
        """One 429 ``queue_full`` answered, for ``switchyard tiers show``: a core publish, so counting it never
        waits on a second ack."""
        await self._nc.publish(subjects.rejected_subject(request.model, request.tier), b"")
