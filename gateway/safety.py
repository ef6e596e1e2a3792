"""The input filter and each tenant's safety policy, at the gateway: a request's text is judged after its rate
limits and before anything is queued; the policy travels on with the request to the worker's output filter.

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

from switchyard.gateway.auth import AuthContext
from switchyard.gateway.errors import OpenAIError
from switchyard.gateway.metrics import GatewayMetrics
from switchyard.shared.config import SafetyConfig
from switchyard.shared.messages import ErrorInfo, GenerateRequest, SafetyPolicy
from switchyard.shared.safety import ALLOWED, ContentFilter, Verdict, default_filter, rule_patterns, wire_policy

log = logging.getLogger("switchyard.gateway")

MODES = ("off", "log", "block")


class InputSafety:
    """One gateway's input filter (its classifier loaded at construction, once) and the wire policies it hands
    the workers."""

    def __init__(self, config: SafetyConfig, metrics: GatewayMetrics | None = None) -> None:
        """Raises ValueError or RuntimeError, saying what to fix, for a configuration that cannot work."""
        self._config = config
        self._metrics = metrics
        self.filter: ContentFilter = default_filter(config)
        patterns = rule_patterns(config)
        threshold = config.classifier_threshold if config.classifier else None
        self._wire = {mode: wire_policy(mode, patterns, threshold) for mode in ("log", "block")}

    def mode(self, tenant_policy: str | None) -> str:
        """The policy in force for a tenant whose own is ``tenant_policy`` (None: the deployment's default)."""
        return tenant_policy if tenant_policy in MODES else self._config.default_policy

    def wire_policy(self, auth: AuthContext | None = None, tenant_policy: str | None = None) -> SafetyPolicy | None:
        """``GenerateRequest.safety`` for the caller (or a tenant's ``tenant_policy``); None when it is off."""
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

    async def screen(self, request: GenerateRequest, parts: list[GenerateRequest]) -> None:
        """Judge a request about to be queued, under the policy it carries (``request.safety``): raises
        ``OpenAIError`` 400 ``content_policy_violation`` when a ``block`` policy refuses it."""
        error = await self.screen_wire(request, parts)
        if error is not None:
            raise OpenAIError(error.status, error.message, code=error.code, param=error.param)

    async def screen_wire(self, request: GenerateRequest, parts: list[GenerateRequest] | None = None,
                          ) -> ErrorInfo | None:
        """As ``screen``, the refusal returned (a batch line fails with it) rather than raised."""
        policy = request.safety
        if policy is None:
            return None
        texts, param = texts_of(request, parts or [request])
        verdict = await self.judge(texts)
        action = "allowed" if verdict.allowed else ("blocked" if policy.mode == "block" else "logged")
        if self._metrics is not None:
            self._metrics.safety_input.labels(request.tier, verdict.category or "none", action).inc()
        if verdict.allowed:
            return None
        log.warning("request %s of tenant %s: input flagged (%s), %s", request.request_id, request.tenant_id,
                    verdict.category, action)
        if action != "blocked":
            return None
        return ErrorInfo(f"This request was refused by the content policy ({verdict.category}: {verdict.reason}).",
                         code="content_policy_violation", param=param, status=400)


def texts_of(request: GenerateRequest, parts: list[GenerateRequest]) -> tuple[list[str], str]:
    """The text a request brings that has not been judged before, and the parameter it came in."""
    if request.messages is not None:
        # A conversation turn (a server-assembled history): only its last message is new.
        messages = request.messages[-1:] if request.truncate_history else request.messages
        texts = [m.content for m in messages]
        texts += [c.arguments for m in messages for c in m.tool_calls or ()]
        return texts, "content" if request.truncate_history else "messages"
    return [p.prompt for p in parts if p.prompt], "prompt"
