"""Every request a worker holds, from the moment it is taken from a queue to its last delta.

    intake ──▶ preparing (tokenized, its grammar compiled, on a prepare thread) ──add──▶ pending
           ──hand_over (a step starts)──▶ active ──drop (its last delta, or refused)──▶ gone
                                 └ num_admitting: handed to the step running now (the engine's capacity, taken
                                   after the previous step, does not count them yet)
    cancel, drain ──abort / end_all──▶ aborts (the next step ends them; their final deltas say why)

Only the event loop touches it: a step gets the adds and aborts ``hand_over`` returns, as data.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nats.aio.msg import Msg
from opentelemetry.context import Context

from switchyard.shared.messages import BatchChoice, ErrorInfo, GenerateRequest, TokenDelta, add_tool_call_parts

if TYPE_CHECKING:
    from switchyard.workers.serving.interface import Prepared

log = logging.getLogger("switchyard.worker")


@dataclass(slots=True)
class Tracked:
    """A request this worker has taken: its timings and counts so far, for its usage record."""

    request: GenerateRequest
    received_at: float
    admitted_at: float = 0.0
    first_token_at: float | None = None
    prompt_tokens: int = 0
    dropped_messages: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_loaded_bytes: int = 0
    choices: dict[int, BatchChoice] = field(default_factory=dict)  # batch lines only: the text so far
    prepared: Prepared | None = None  # its prompt, as the engine prepared it at intake
    superseded: bool = False  # a gateway took this worker for dead and continued it elsewhere: not billed here
    trace_context: Context | None = None  # the gateway's trace, from the message headers (shared/tracing.py)

    def collect(self, delta: TokenDelta) -> None:
        choice = self.choices.setdefault(delta.index, BatchChoice(delta.index))
        choice.text += delta.text
        choice.finish_reason = delta.finish_reason or choice.finish_reason
        add_tool_call_parts(choice.tool_calls, delta.tool_calls)


class HeldRequests:
    """See the module docstring. ``pending`` pairs each request with its JetStream message (acked once the
    engine took it or it was refused)."""

    def __init__(self) -> None:
        self.active: dict[str, Tracked] = {}
        self.preparing: dict[str, Tracked] = {}  # taken from a queue, being prepared (intake.py)
        self.pending: list[tuple[Tracked, Msg]] = []
        self.aborts: dict[str, ErrorInfo | None] = {}  # None: the client cancelled
        self.num_admitting = 0
        self.work = asyncio.Event()  # an add or an abort waits for the step loop

    def holds(self, request_id: str) -> bool:
        """Whether ``request_id`` is running here or waiting for the next step."""
        return request_id in self.active or any(t.request.request_id == request_id for t, _ in self.pending)

    def tracked(self, request_id: str) -> Tracked | None:
        """``request_id``'s entry wherever it is here: being prepared, waiting for the next step, or running."""
        found = self.preparing.get(request_id) or self.active.get(request_id)
        return found or next((t for t, _ in self.pending if t.request.request_id == request_id), None)

    def has_taken(self, request_id: str) -> bool:
        """Whether ``request_id`` is here at all: held, or still being prepared."""
        return self.tracked(request_id) is not None

    def has_work(self) -> bool:
        """Whether the next step has adds or aborts to hand to the engine."""
        return bool(self.pending) or bool(self.aborts)

    def add(self, tracked: Tracked, msg: Msg) -> None:
        self.pending.append((tracked, msg))
        self.work.set()

    def abort(self, request_id: str) -> None:
        """The client went away: the next step frees the request (unless something else ends it first)."""
        self.aborts.setdefault(request_id, None)
        self.work.set()

    def end_all(self, error: ErrorInfo) -> None:
        """End every running request with ``error`` at the next step (its final deltas carry it)."""
        log.warning("ending %d running requests: %s", len(self.active), error.code)
        self.aborts.update(dict.fromkeys(self.active, error))

    def hand_over(self) -> tuple[list[tuple[Tracked, Msg]], dict[str, ErrorInfo | None]]:
        """The adds and aborts for the step starting now; the adds count as running from here on."""
        adds, self.pending = self.pending, []
        aborts, self.aborts = self.aborts, {}
        for tracked, _ in adds:
            self.active[tracked.request.request_id] = tracked
        self.num_admitting = len(adds)
        return adds, aborts

    def running_by_tier(self) -> dict[str, int]:
        running: dict[str, int] = {}
        for tracked in list(self.active.values()):
            running[tracked.request.tier] = running.get(tracked.request.tier, 0) + 1
        return running
