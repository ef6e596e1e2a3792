"""The HTTP side of admission, as every route uses it: who calls (the ``Authorization`` header), then the domain's
admission pipeline (domain/admission/) on the request's ticket, and what the response carries from it.

    authenticated ──▶ request_ticket ──▶ admit: tier header ─▶ pipeline.check ─▶ request.state: the
                                                                   model and tier (error metrics' labels), the
                                                                   x-ratelimit-* headers (every response)
    bounded_body  ──▶ a body far over its bounds refused before it is validated (domain/api/bounds.py); the
                      schema sizes it measured kept for the route's check of the model (``schema_sizes``)
    answered      ──▶ the service's answer to an admitted ticket; one that fails before the service took the
                      ticket on gives back what the ticket holds (its seat, its reserved tokens)
    counted       ──▶ admit_call: a route that generates nothing (files, batches, usage, conversations) passes
                      the same pipeline as an ``Origin.CALL`` ticket: its key's request rate, the input filter
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from switchyard.domain.admission.ticket import Origin, RequestBody, Ticket
from switchyard.domain.api.bounds import Kind, SchemaSizes, check_raw_bounds
from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.gateway.request_ids import current_request_id
from switchyard.gateway.services import GatewayServices
from switchyard.shared.config import RequestLimits
from switchyard.shared.tiers import TIER_NAMES
from switchyard.shared.tracing import tracer

TIER_HEADER = "X-Switchyard-Tier"

T = TypeVar("T")


def authenticated(services: GatewayServices) -> Callable[[Request], Awaitable[AuthContext]]:
    """The dependency every /v1 route takes: the caller, as gateway/gatekeeper.py found it before the body was
    read (an app without that middleware looks it up here)."""

    async def caller(request: Request) -> AuthContext:
        auth = getattr(request.state, "auth", None)
        if auth is None:
            with tracer.start_as_current_span("authenticate"):
                auth = await services.authenticator.authenticate(request.headers.get("authorization", ""))
            request.state.auth = auth
        return auth

    return caller


def bounded_body(limits: RequestLimits, kind: Kind) -> Callable[[Request], Awaitable[None]]:
    """A route's dependency: its body's bounds (domain/api/bounds.py), read off the JSON before FastAPI validates
    it into the model (FastAPI solves dependencies first, with the body decoded and kept): a body far over them
    costs the event loop its decoding, not its validation. The schema sizes it measured are kept for the route's
    check of the validated model (``schema_sizes``), so that each schema is serialized once per request."""

    async def check(request: Request) -> None:
        try:
            decoded = await request.json()
        except ValueError:
            return  # not JSON: validation says so
        request.state.schema_sizes = check_raw_bounds(decoded, limits, kind)

    return check


def schema_sizes(request: Request) -> SchemaSizes | None:
    """The schema sizes ``bounded_body`` measured off this request's body (None: it measured none), for
    ``check_bounds`` / ``check_response_bounds`` to take instead of serializing the schemas again."""
    return getattr(request.state, "schema_sizes", None)


def counted(services: GatewayServices) -> Callable[[Request], Awaitable[AuthContext]]:
    """The dependency of routes that generate nothing: the caller, admitted as an API call (``admit_call``)."""
    caller = authenticated(services)

    async def admitted(request: Request) -> AuthContext:
        auth = await caller(request)
        await admit_call(services, request, auth)
        return auth

    return admitted


async def admit_call(services: GatewayServices, request: Request, auth: AuthContext, **fields) -> None:
    """Admit an API call of ``auth``'s (``fields``: what the input filter judges, e.g. a conversation's system
    prompt); raises the pipeline's refusal. It holds nothing past the check, so it is settled at once."""
    ticket = await admit(services, request, Ticket(Origin.CALL, auth, current_request_id(), "", **fields))
    await services.admission.settle(ticket, 0)


def request_ticket(auth: AuthContext, body: RequestBody, **fields) -> Ticket:
    """The ticket of an API request: its body as admission reads it (``fields``: what the route knows better)."""
    return Ticket.for_body(Origin.REQUEST, auth, current_request_id(), body, **fields)


async def admit(services: GatewayServices, request: Request, ticket: Ticket) -> Ticket:
    """Run the admission pipeline on ``ticket``; raises its refusal. Either way the error metrics get the model and
    tier as far as they were decided, and the response the rate-limit headers."""
    request.state.model = ticket.model or None
    ticket.tier_override = _tier_header(services, request)
    began, outcome = time.perf_counter(), "refused"
    try:
        admitted = await services.admission.check(ticket)
        outcome = "admitted"
        return admitted
    finally:
        services.metrics.admission.labels(ticket.tier or "", outcome).observe(time.perf_counter() - began)
        request.state.tier = ticket.tier
        request.state.model = ticket.model or None
        request.state.rate_headers = ticket.headers


async def answered(services: GatewayServices, ticket: Ticket, answer: Awaitable[T]) -> T:
    """``answer``, the service's reply to the admitted ``ticket``. When it fails before the service took the ticket
    on (a background response that cannot be stored, a prompt refused as it is built), nothing else would settle
    it: its seat and reserved tokens go back here. A service that took it on settled it itself, and a ticket
    settles once. Shielded: a cancelled handler must still give the seat back."""
    try:
        return await answer
    except BaseException:
        await asyncio.shield(services.admission.settle(ticket, 0))
        raise


def _tier_header(services: GatewayServices, request: Request) -> str | None:
    """A trusted deployment's tier for the request (``gateway.allow_tier_header``), when it names one."""
    tier = request.headers.get(TIER_HEADER)
    if tier is None or not services.config.gateway.allow_tier_header:
        return None
    if tier not in TIER_NAMES:
        raise OpenAIError(400, f"Unknown tier {tier!r}; known: {', '.join(TIER_NAMES)}.", code="invalid_tier",
                          param=TIER_HEADER)
    return tier
