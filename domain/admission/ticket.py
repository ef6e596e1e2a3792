"""What admission decides about: a ``Ticket``, one per request (or batch, or batch line) on its way to a queue.

    door (route, batch runner) ──▶ Ticket(origin, auth, what the body asks for)
        ──▶ each policy in order: check(ticket) fills in what it decides (tier, model, reservation, safety policy)
        ──▶ queued, run ──▶ each policy that passed: settle(ticket, used tokens)

The body is read through the few things every request body says about itself (domain/api): its characters, the
completion tokens and choices it asks for, the text ``auto`` routing judges, the texts the input filter judges.
A new endpoint makes its tickets with ``for_body`` and needs nothing else here.
"""

from __future__ import annotations

import datetime as dt
import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from switchyard.domain.auth import AuthContext
from switchyard.domain.limits import Reservation, estimate_tokens
from switchyard.shared.messages import SafetyPolicy


class Origin(enum.Enum):
    """Where a ticket comes from: each policy says which it applies to."""

    REQUEST = "request"  # an API request that generates: chat, completions, a conversation turn
    CALL = "call"  # an API request that generates nothing: files, batches, usage, conversations' other routes
    BATCH = "batch"  # a batch about to start: its lines' estimated tokens together
    BATCH_LINE = "batch_line"  # one line of a running batch, about to be queued


class RequestBody(Protocol):
    """What a request body tells admission about itself (ChatCompletionRequest, CompletionRequest, ...)."""

    # Read-only: each body narrows them its own way (a Literal tier, none at all, a model the route fills in).
    @property
    def model(self) -> str | None: ...

    @property
    def service_tier(self) -> str | None: ...

    @property
    def max_output_tokens(self) -> int | None: ...

    @property
    def num_choices(self) -> int: ...

    def num_chars(self) -> int: ...

    def routing_text(self) -> str: ...

    def screened_texts(self) -> tuple[list[str], str]: ...


@dataclass(frozen=True, slots=True)
class ServiceTier:
    """The tier that runs a request, and what its response's ``service_tier`` says (admission/service_tier.py)."""

    tier: str  # the platform tier that runs it
    label: str = "default"  # OpenAI's: default, flex, priority

    @property
    def is_flex(self) -> bool:
        return self.label == "flex"


@dataclass(slots=True)
class Ticket:
    origin: Origin
    auth: AuthContext
    request_id: str
    model: str  # as asked, until routing resolves it to the served model
    num_chars: int = 0
    max_tokens: int | None = None  # completion tokens asked for (None: the model's own limit)
    n: int = 1  # choices generated, over every prompt
    estimated_tokens: int = 0  # what it may use: reserved by rate limits, counted by enqueued-token limits
    service_tier: str | None = None  # as asked (OpenAI's service_tier)
    tier_override: str | None = None  # a trusted deployment's tier header (gateway.allow_tier_header)
    routing_text: str = ""  # what ``auto`` routing judges
    texts: list[str] = field(default_factory=list)  # what the input filter judges
    texts_param: str = "messages"  # the parameter they came in, named by a refusal
    # Decided by the policies, in order.
    service: ServiceTier | None = None
    reservation: Reservation | None = None
    holds_seat: bool = False  # counted among its tenant's open requests until settled (concurrency.py)
    budget_reserved: int = 0  # tokens held in its tenant's month until settled (budget.py)
    budget_month: dt.date | None = None  # the month they are held in
    safety: SafetyPolicy | None = None  # the policy the worker's output filter applies (None: off)
    headers: dict[str, str] = field(default_factory=dict)  # every response to it carries them (x-ratelimit-*)
    settled: bool = False

    @property
    def tier(self) -> str | None:
        return None if self.service is None else self.service.tier

    @classmethod
    def for_body(cls, origin: Origin, auth: AuthContext, request_id: str, body: RequestBody, **fields: Any) -> Ticket:
        """The ticket of a request ``body``; ``fields`` override what the body says (a conversation turn's
        history is the server's, not the body's)."""
        texts, param = body.screened_texts()
        asked: dict[str, Any] = dict(model=body.model, num_chars=body.num_chars(), max_tokens=body.max_output_tokens,
                     n=body.num_choices, service_tier=body.service_tier, routing_text=body.routing_text(),
                     texts=texts, texts_param=param)
        asked.update(fields)
        estimated = estimate_tokens(asked["num_chars"], asked["max_tokens"], asked["n"])
        return cls(origin, auth, request_id, estimated_tokens=estimated, **asked)
