"""Admission policy: a worker serves the model now (after routing named it). A model no worker serves is 404
``model_not_found``; one served a moment ago, or configured here, is 503 ``model_unavailable`` to retry
(domain/registry.py). A batch's file is checked against the live models before it starts, with its other line
errors."""

from __future__ import annotations

from switchyard.domain.admission.pipeline import Policy
from switchyard.domain.admission.ticket import Ticket
from switchyard.domain.errors import model_not_found
from switchyard.domain.registry import ModelRegistry


class ModelServed(Policy):
    def __init__(self, registry: ModelRegistry) -> None:
        self._registry = registry

    async def check(self, ticket: Ticket) -> None:
        if not await self._registry.is_served(ticket.model):
            raise model_not_found(ticket.model)
