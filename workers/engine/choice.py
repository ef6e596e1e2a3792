"""The engine's state per request and per choice, and what a choice's text goes through on its way out.

    detokenizer ──▶ emittable (a continuation's resent text dropped, an echo or unsent text added)
                ──▶ output filter (safety: may hold a partial word back, or halt the choice)
                ──▶ tool-call parser (content and tool_calls apart) ──▶ the choice's delta

The engine decides when a choice ends (EOS, stop string, length, a complete grammar) and asks ``final`` for what
its last delta carries; everything between a token id and the text a client sees is here.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

from switchyard.scheduler import Sequence
from switchyard.shared.messages import SamplingParams, TokenLogprob, ToolCallDelta
from switchyard.workers.engine.detokenizer import IncrementalDetokenizer
from switchyard.workers.engine.output_filter import StreamGuard
from switchyard.workers.engine.tool_parser import ToolCallParser

log = logging.getLogger("switchyard.engine")


@dataclass(slots=True)
class RequestState:
    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    seq_ids: list[str]
    held: list[Sequence] = field(default_factory=list)  # choices 1..n-1, waiting for choice 0's prefill
    num_dropped_messages: int = 0
    num_finished: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0


@dataclass(slots=True)
class Choice:
    """Per-sequence engine state (``Sequence.data``)."""

    request: RequestState
    index: int
    detokenizer: IncrementalDetokenizer
    generator: random.Random | None  # a seeded request's uniforms (sampling.make_generator)
    num_unreported_tokens: int = 0
    unreported_logprobs: list[TokenLogprob] | None = None  # only when the request asked for logprobs
    # A continuation (GenerateRequest.resume): characters of text the client has already received that the
    # detokenizer will emit again (to drop), or text it emitted while primed that the client never got (to send).
    skip_chars: int = 0
    unsent_text: str = ""
    matcher: object | None = None  # the grammar its tokens must follow (llguidance), None for free text
    tools: ToolCallParser | None = None  # reads tool calls out of its text, when the request has tools
    guard: StreamGuard | None = None  # the output safety filter, when the tenant's policy is not off

    def emittable(self, text: str) -> str:
        """``text`` from the detokenizer, less what the client already has, plus what it is still owed."""
        if self.skip_chars:
            cut = min(self.skip_chars, len(text))
            text, self.skip_chars = text[cut:], self.skip_chars - cut
        if self.unsent_text:
            text, self.unsent_text = self.unsent_text + text, ""
        return text

    def follow_grammar(self, token_id: int) -> None:
        """A sampled token (not EOS) moves the grammar on."""
        if self.matcher is None:
            return
        self.matcher.consume_token(token_id)
        if self.matcher.is_error():  # cannot happen for a token its mask allowed; never loop on it
            log.error("request %s left its grammar: %s", self.request.request_id, self.matcher.get_error())

    @property
    def grammar_is_complete(self) -> bool:
        return self.matcher is not None and self.matcher.is_stopped()

    def outgoing(self, text: str) -> tuple[str, list[ToolCallDelta] | None, bool]:
        """Emittable text through the output filter and the tool-call parser: (content, tool calls, halted)."""
        if self.guard is not None:
            text = self.guard.feed(text)
            if self.guard.is_halted:
                return "", None, True
        if self.tools is None:
            return text, None, False
        text, calls = self.tools.feed(text)
        return text, calls or None, False

    def final(self, text: str, reason: str) -> tuple[str, list[ToolCallDelta] | None, str]:
        """The last delta's content, tool calls and finish reason (the end's text is judged too, and a reply
        that called tools finishes with ``tool_calls``, as OpenAI's does)."""
        if self.guard is not None:
            text, reason = self.guard.finish(text, reason)
        if self.tools is None:
            return text, None, reason
        text, calls = self.tools.feed(text)
        more_text, more_calls = self.tools.finish()
        if self.tools.num_calls and reason == "stop":
            reason = "tool_calls"
        return text + more_text, (calls + more_calls) or None, reason
