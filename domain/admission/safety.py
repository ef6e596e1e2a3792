"""Admission policy: the input filter under each tenant's safety policy. A request's text (a batch line's too) is
judged after its limits and before anything is queued; the policy travels on with the request to the worker's
output filter.

    tenant's policy (tenants.safety_policy, else gateway.safety.default_policy)
      off    nothing judged, on the way in or out
      log    judged; a flagged request runs, and is logged (request id, tenant, category: never the text) and
             counted (switchyard:safety_input_verdicts_total / the worker's safety_output_verdicts_total)
      block  a flagged prompt is refused, 400 content_policy_violation; a flagged reply halts with
             finish_reason content_filter

What is judged: every message of a chat request (a client sends the whole history, and may write any of it),
only the new message of a conversation turn (the stored history was judged when it was new), each prompt of a
completion. Prompts given as token ids cannot be read here (the gateway has no tokenizer): only their output is
filtered. Text up to ``inline_max_chars`` is judged on the event loop, in well under a millisecond
(bench/safety.py); longer text on a thread, so one huge prompt does not stall every other request.
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter

from switchyard.domain.admission.pipeline import Policy
from switchyard.domain.admission.ticket import Origin, Ticket
from switchyard.domain.auth import AuthContext
from switchyard.domain.errors import OpenAIError
from switchyard.shared.config import SafetyConfig
from switchyard.shared.messages import SafetyPolicy
from switchyard.shared.safety import ALLOWED, ContentFilter, Verdict, default_filter, rule_patterns, wire_policy

log = logging.getLogger("switchyard.safety")

MODES = ("off", "log", "block")


class InputSafety:
    """One gateway's input filter (its classifier loaded at construction, once) and the wire policies it hands
    the workers."""

    def __init__(self, config: SafetyConfig, verdicts: Counter | None = None) -> None:
        """``verdicts``: counted by tier, category and action (the gateway's safety_input_verdicts). Raises
        ValueError or RuntimeError, saying what to fix, for a configuration that cannot work."""
        self._config = config
        self._verdicts = verdicts
        self.filter: ContentFilter = default_filter(config)
        patterns = rule_patterns(config)
        threshold = config.classifier_threshold if config.classifier else None
        self._wire = {mode: wire_policy(mode, patterns, threshold) for mode in ("log", "block")}

    def mode(self, tenant_policy: str | None) -> str:
        """The policy in force for a tenant whose own is ``tenant_policy`` (None: the deployment's default)."""
        return tenant_policy if tenant_policy in MODES else self._config.default_policy

    def wire_policy(self, auth: AuthContext | None = None, tenant_policy: str | None = None) -> SafetyPolicy | None:
        """``GenerateRequest.safety`` for the caller (or a tenant whose own policy is ``tenant_policy``); None when it
        is off."""
        return self._wire.get(self.mode(auth.safety_policy if auth is not None else tenant_policy))

    async def judge(self, texts: list[str]) -> Verdict:
        """The first flagged verdict among ``texts``, else allowed."""
        if sum(map(len, texts)) <= self._config.inline_max_chars:
            return self._judge_all(texts)
        return await asyncio.to_thread(self._judge_all, texts)

    def _judge_all(self, texts: list[str]) -> Verdict:
        for text in texts:
            if text:
                verdict = self.filter.check(text)
                if not verdict.allowed:
                    return verdict
        return ALLOWED

    async def screen(self, ticket: Ticket) -> None:
        """Judge a request about to be queued under the policy it carries (``ticket.safety``): raises
        ``OpenAIError`` 400 ``content_policy_violation`` when a ``block`` policy refuses it."""
        policy = ticket.safety
        if policy is None:
            return
        verdict = await self.judge(ticket.texts)
        action = "allowed" if verdict.allowed else ("blocked" if policy.mode == "block" else "logged")
        if self._verdicts is not None:
            self._verdicts.labels(ticket.tier, verdict.category or "none", action).inc()
        if verdict.allowed:
            return
        log.warning("request %s of tenant %s: input flagged (%s), %s", ticket.request_id, ticket.auth.tenant_id,
                    verdict.category, action)
        if action == "blocked":
            raise OpenAIError(400, f"This request was refused by the content policy ({verdict.category}: "
                              f"{verdict.reason}).", code="content_policy_violation", param=ticket.texts_param)


class InputFilter(Policy):
    """Last, once the request is let through by everything cheaper: the text it brings that was not judged before
    (every message of a chat request, a conversation turn's new message, each prompt given as text, a new
    conversation's system prompt)."""

    origins = frozenset({Origin.REQUEST, Origin.CALL, Origin.BATCH_LINE})

    def __init__(self, safety: InputSafety | None) -> None:
        """``safety`` None: nothing judged and no policy sent (a deployment without filters)."""
        self._safety = safety

    async def check(self, ticket: Ticket) -> None:
        if self._safety is not None:
            ticket.safety = self._safety.wire_policy(ticket.auth)
            await self._safety.screen(ticket)
