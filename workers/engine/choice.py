"""The engine's state per request and per choice, and what a choice's text goes through on its way out.

    detokenizer ──▶ emittable (a continuation's resent text dropped, an echo or unsent text added)
                ──▶ output filter (safety: may hold a partial word back, or halt the choice)
                ──▶ tool-call parser (content and tool_calls apart) ──▶ the choice's delta

The engine decides when a choice ends (EOS, stop string, length, a complete grammar) and asks ``final`` for what
its last delta carries; everything between a token id and the text a client sees is here, and so is how a
continuation's choice takes up the text its first worker already sent (``resume``).
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeAlias, cast

from switchyard.scheduler import Sequence
from switchyard.shared.kv_events import cache_salt
from switchyard.shared.messages import ErrorInfo, GenerateRequest, SamplingParams, TokenLogprob, ToolCallDelta, Usage
from switchyard.workers.engine.detokenizer import IncrementalDetokenizer
from switchyard.workers.engine.output_filter import OutputSafety, StreamGuard
from switchyard.workers.engine.prompts import PreparedPrompt, RequestRejected
from switchyard.workers.engine.sampling import GREEDY_TEMPERATURE, make_generator
from switchyard.workers.engine.tool_calls import call_id
from switchyard.workers.engine.tool_parser import ToolCallParser

if TYPE_CHECKING:
    import llguidance

# A prompt prepared by our engine: its grammar, if any, as an llguidance matcher (guided.Grammars).
MatcherPrompt: TypeAlias = "PreparedPrompt[llguidance.LLMatcher]"

log = logging.getLogger("switchyard.engine")


@dataclass(slots=True)
class RequestState:
    request_id: str
    params: SamplingParams
    num_prompt_tokens: int
    seq_ids: list[str]
    held: list[Sequence] = field(default_factory=list)  # choices 1..n-1, waiting for choice 0's prefill
    num_finished: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0

    def usage(self) -> Usage:
        """The request's usage so far, over every choice."""
        return Usage(prompt_tokens=self.num_prompt_tokens, completion_tokens=self.completion_tokens,
                     cached_tokens=self.cached_tokens)


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


def choice_of(seq: Sequence) -> Choice:
    """The engine's state of ``seq``: the scheduler keeps it untyped (``Sequence.data``), and every sequence this
    engine makes carries a ``Choice`` (``new_request``)."""
    return cast(Choice, seq.data)


def resume(seq: Sequence, token_ids: list[int], text_len: int) -> None:
    """Make a new sequence go on from ``token_ids`` generated elsewhere, of whose text the client has
    ``text_len`` characters."""
    choice = choice_of(seq)
    try:
        seq.resume(token_ids)
    except ValueError as exc:
        raise RequestRejected(ErrorInfo(str(exc), code="invalid_value", param="resume")) from exc
    choice.take_up(token_ids, text_len)
    if choice.generator is not None and choice.request.params.temperature >= GREEDY_TEMPERATURE:
        # One uniform per sampled token: a seeded request goes on as it would have on the first worker.
        for _ in token_ids:
            choice.generator.random()


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


def check_resumable(req: GenerateRequest) -> None:
    """A continuation has one choice and no tools (its deltas would not say where each choice was)."""
    if req.resume is not None and (req.sampling.n != 1 or req.tool_use is not None):
        param = "n" if req.sampling.n != 1 else "tools"
        raise RequestRejected(ErrorInfo(f"A request with {param} set cannot be resumed.",
                                        code="invalid_value", param=param))


def new_request(req: GenerateRequest, prepared: MatcherPrompt, tokenizer, safety: OutputSafety, priority: int,
                ) -> tuple[RequestState, list[Sequence]]:
    """``req``'s state and a sequence per choice, all built before the scheduler sees any of it: a request that
    fails here (``RequestRejected``) leaves nothing behind. A continuation's one choice goes on from its tokens."""
    params, prompt_ids, max_tokens = req.sampling, prepared.token_ids, prepared.max_tokens
    check_resumable(req)
    state = RequestState(req.request_id, params, len(prompt_ids), seq_ids=[])
    arrival = time.monotonic()
    salt = cache_salt(req)
    seqs = []
    for index in range(params.n):
        seq_id = req.request_id if params.n == 1 else f"{req.request_id}#{index}"
        matcher = None
        if prepared.matcher is not None:  # each choice follows the grammar on its own
            matcher = prepared.matcher if index == 0 else prepared.matcher.deep_copy()
        choice = make_choice(req, state, index, prompt_ids, tokenizer, safety, matcher)
        seqs.append(Sequence(seq_id, list(prompt_ids), max_tokens, priority=priority, arrival=arrival, data=choice,
                             cache_salt=salt, tenant=req.tenant_id or ""))
        state.seq_ids.append(seq_id)
    if req.resume is not None:
        resume(seqs[0], req.resume.token_ids, req.resume.text_len)
    return state, seqs
