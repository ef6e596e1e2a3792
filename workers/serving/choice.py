"""An engine's state per request and per choice, and what a choice's text goes through on its way out (both
engines: ours keeps a ``Choice`` on each scheduler sequence, workers/engine/sequences.py; the vLLM engine one per
vLLM output).

    detokenizer ──▶ emittable (a continuation's resent text dropped, an echo or unsent text added)
                ──▶ output filter (safety: may hold a partial word back, or halt the choice)
                ──▶ tool-call parser (content and tool_calls apart) ──▶ the choice's delta

The engine decides when a choice ends (EOS, stop string, length, a complete grammar) and asks ``final`` for what
its last delta carries; everything between a token id and the text a client sees is here, and so is how a
continuation's choice takes up the text its first worker already sent (``Choice.take_up``).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from switchyard.shared.messages import ErrorInfo, GenerateRequest, SamplingParams, TokenLogprob, ToolCallDelta, Usage
from switchyard.workers.serving.detokenizer import IncrementalDetokenizer
from switchyard.workers.serving.output_filter import OutputSafety, StreamGuard
from switchyard.workers.serving.prompts import RequestRejected
from switchyard.workers.serving.tool_calls import call_id
from switchyard.workers.serving.tool_parser import ToolCallParser

if TYPE_CHECKING:
    import llguidance

    from switchyard.scheduler import Sequence

log = logging.getLogger("switchyard.engine")


@dataclass(slots=True)
class RequestState:
    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    seq_ids: list[str]
    held: list[Sequence] = field(default_factory=list)  # ours: choices 1..n-1, waiting for choice 0's prefill
    num_finished: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    kv_loaded_bytes: int = 0  # its prompt's KV loaded from a tier or another host (Usage.kv_loaded_bytes)
    handover: bool = False  # a prefill worker's part: it ends with its first token (GenerateRequest.handover)

    def usage(self) -> Usage:
        """The request's usage so far, over every choice."""
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.completion_tokens,
                     cached_tokens=self.cached_tokens, kv_loaded_bytes=self.kv_loaded_bytes)


@dataclass(slots=True)
class Choice:
    """Per-choice engine state (ours: ``Sequence.data``)."""

    request: RequestState
    index: int
    detokenizer: IncrementalDetokenizer
    generator: random.Random | None  # a seeded request's uniforms (make_generator)
    num_unreported_tokens: int = 0
    unreported_logprobs: list[TokenLogprob] | None = None  # only when the request asked for logprobs
    # A continuation (GenerateRequest.resume): characters of text the client has already received that the
    # detokenizer will emit again (to drop), or text it emitted while primed that the client never got (to send).
    skip_chars: int = 0
    unsent_text: str = ""
    matcher: llguidance.LLMatcher | None = None  # the grammar its tokens must follow, None for free text
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

    def take_up(self, token_ids: list[int], text_len: int) -> None:
        """A continuation: ``token_ids`` were generated elsewhere and the client has ``text_len`` characters of
        their text (an echo included); the detokenizer, grammar and output filter go on from there, and the text
        sends only what the client lacks."""
        primed = self.detokenizer.add_tokens(token_ids)
        if self.matcher is not None and not self.matcher.consume_tokens(token_ids):
            raise RequestRejected(ErrorInfo("The resumed tokens do not follow the request's response_format.",
                                            code="invalid_value", param="resume"))
        if self.detokenizer.is_stopped:
            raise RequestRejected(ErrorInfo("The resumed tokens already contain a stop string.",
                                            code="invalid_value", param="resume"))
        # The same ids decode to the same text and hold back the same tail, so these differ only if the first
        # worker decoded differently; either way the client gets each character once. What the client is owed
        # before them (an echoed prompt) counts as sent text too.
        owed = self.unsent_text + primed
        self.skip_chars = max(0, text_len - len(owed))
        self.unsent_text = owed[text_len:]
        if self.guard is not None:
            self.guard.prime(owed[:text_len])

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


def make_generator(seed: int | None) -> random.Random | None:
    """The uniform source of a seeded request, ``None`` (torch's global CPU RNG) for an unseeded one."""
    if seed is None:
        return None
    return random.Random(seed)


def make_choice(req: GenerateRequest, state: RequestState, index: int, prompt_ids: list[int], tokenizer,
                safety: OutputSafety, matcher: llguidance.LLMatcher | None = None) -> Choice:
    """Choice ``index`` of ``req``: its detokenizer (stop strings), seeded uniforms, logprobs, output filter, tool-call
    parser and echoed prompt; ``matcher``: the grammar its tokens follow, when the engine applies it itself."""
    params = req.sampling
    seed = None if params.seed is None else params.seed + index
    choice = Choice(state, index, IncrementalDetokenizer(tokenizer, stop=params.stop, prompt_token_ids=prompt_ids),
                    make_generator(seed), unreported_logprobs=[] if params.logprobs else None,
                    guard=safety.guard(req, index), matcher=matcher)
    if req.tool_use is not None and req.tool_use.choice != "none":
        choice.tools = ToolCallParser(lambda k, i=index: call_id(req.request_id, i, k))
    if params.echo:  # legacy completions: the text starts with the prompt, as the client wrote it
        choice.unsent_text = req.prompt if req.prompt is not None else tokenizer.decode(prompt_ids)
    return choice


def check_continuable(req: GenerateRequest) -> None:
    """A continuation has one choice and no tools (its deltas would not say where each choice was)."""
    if req.resume is not None and not req.continuable:
        param = "n" if req.sampling.n != 1 else "tools"
        raise RequestRejected(ErrorInfo(f"A request with {param} set cannot be resumed.",
                                        code="invalid_value", param=param))
