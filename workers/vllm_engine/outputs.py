"""vLLM's token ids, through our choice machinery, into the same deltas our engine sends.

    vLLM RequestOutput (DELTA: the step's new token ids, their logprobs, finish_reason)
      └─▶ ChoiceRun.advance(): for each token, as our engine does it (workers/engine/deltas.py ``Deltas.on_token``):
            last token of a "stop" ──▶ EOS (or the grammar's end): not text, no logprob, the choice ends "stop"
            detokenizer (stop strings) ──▶ a stop string: the choice ends "stop", the vLLM request is aborted
            last token of a "length" ──▶ the choice ends "length"
            output filter + tool-call parser (Choice.outgoing) ──▶ halted: ends "content_filter", aborted
      └─▶ a prefill's choice (``handover``, kv_transfer.py): its first token as above; what vLLM generates after it
            is dropped, and the choice ends HANDOVER when vLLM ends the request (its kv_transfer_params with it)
      └─▶ at most one delta per choice per step (several tokens in one under speculative decoding)

Text is never vLLM's: it runs with ``detokenize=False``, so the wire (text, held-back split characters, stop
strings, tool_calls deltas, safety halts) is identical to our engine's by construction, not by imitation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from switchyard.shared.messages import HANDOVER, ErrorInfo, TokenDelta, TokenLogprob, ToolCallDelta
from switchyard.workers.serving.choice import Choice
from switchyard.workers.serving.token_texts import TokenTexts

# vLLM's finish reasons that end a choice without a token of ours to account for.
ABORT, ERROR = "abort", "error"


@dataclass(slots=True)
class Ending:
    """How a choice ended in a step: its finish reason, the end's text (not yet through the output filter and the
    tool-call parser: ``Choice.final`` takes it), and whether vLLM must still be told (we ended it). A hand-over
    (``HANDOVER``) carries vLLM's ``kv_transfer_params`` for the decode side."""

    reason: str
    text: str = ""
    abort_vllm: bool = False
    kv_transfer: dict[str, Any] | None = None


@dataclass(slots=True)
class ChoiceRun:
    """One choice of a request as vLLM runs it (vLLM request ``vllm_id``), around our ``Choice``."""

    choice: Choice
    vllm_id: str
    prompt: dict  # vLLM's prompt input (token ids and cache salt)
    sampling: dict  # vLLM SamplingParams keyword arguments
    num_output_tokens: int = 0  # generated here and elsewhere (a continuation's resumed tokens count: all billed)
    num_cached_tokens: int = 0
    is_added: bool = False  # given to vLLM (choices after the first wait for its first token, see engine.py)
    is_started: bool = False  # has produced a token
    # A prefill's part (GenerateRequest.handover): one token of ours, then HANDOVER (vLLM runs one more: kv_transfer.py)
    handover: bool = False
    token_ids: list[int] = field(default_factory=list)  # this step's, for the delta

    def advance(self, new_ids: list[int], logprobs, finish_reason: str | None, texts: TokenTexts,
                kv_transfer: dict[str, Any] | None = None) -> tuple[str, list[ToolCallDelta], Ending | None]:
        """Take a step's new tokens; returns the content and tool calls to send and how the choice ended (None:
        it goes on). ``finish_reason``: vLLM's, when this output is the request's last; ``kv_transfer``: its
        kv_transfer_params then."""
        choice = self.choice
        out_text = ""
        out_calls: list[ToolCallDelta] = []
        if self.handover and self.is_started:  # the prefill's extra token (kv_transfer.py): not the client's
            return out_text, out_calls, _handed_over(finish_reason, kv_transfer)
        self.is_started = self.is_started or bool(new_ids)
        for i, token_id in enumerate(new_ids):
            last = i == len(new_ids) - 1 and finish_reason is not None
            choice.num_unreported_tokens += 1
            self.num_output_tokens += 1
            self.token_ids.append(token_id)
            if choice.unreported_logprobs is not None and logprobs:
                choice.unreported_logprobs.append(_logprob(logprobs[i], token_id, choice.request.params.top_logprobs,
                                                           texts))
            if last and finish_reason == "stop":  # EOS, or the grammar's end (vLLM closes it with EOS)
                if choice.unreported_logprobs:  # the EOS token ends the text; it is not part of it
                    choice.unreported_logprobs.pop()
                return out_text, out_calls, Ending("stop", choice.emittable(choice.detokenizer.flush()))
            text = choice.detokenizer.add_token(token_id)
            if choice.detokenizer.is_stopped:
                return out_text, out_calls, Ending("stop", choice.emittable(text), abort_vllm=not last)
            if last:  # length (max_tokens or the context), or an error inside vLLM
                text = choice.emittable(text + choice.detokenizer.flush())
                return out_text, out_calls, Ending("length" if finish_reason != ERROR else ERROR, text)
            text, calls, halted = choice.outgoing(choice.emittable(text))
            if halted:  # flagged under a block policy: nothing more goes out, its seat freed now
                return out_text, out_calls, Ending("content_filter", abort_vllm=True)
            out_text += text
            out_calls.extend(calls or ())
            if self.handover:  # its first token is out: what vLLM ran after it is not the client's
                return out_text, out_calls, _handed_over(finish_reason, kv_transfer)
        if finish_reason is not None:  # ended with no token this step (an error inside vLLM, or an empty last output)
            text = choice.emittable(choice.detokenizer.flush())
            return out_text, out_calls, Ending(ERROR if finish_reason == ERROR else "stop", text)
        return out_text, out_calls, None

    def delta(self, request_id: str, text: str, calls: list[ToolCallDelta] | None, reason: str | None = None,
              usage=None, error: ErrorInfo | None = None) -> TokenDelta:
        """The choice's delta for this step: its tokens since the last one, their logprobs, and ``text``."""
        choice = self.choice
        delta = TokenDelta(request_id, text=text, num_tokens=choice.num_unreported_tokens, index=choice.index,
                           finish_reason=reason, usage=usage, logprobs=choice.unreported_logprobs or None,
                           error=error, tool_calls=calls or None, token_ids=self.token_ids or None)
        choice.num_unreported_tokens = 0
        if choice.unreported_logprobs:
            choice.unreported_logprobs = []
        self.token_ids = []
        return delta


def _handed_over(finish_reason: str | None, kv_transfer: dict[str, Any] | None) -> Ending | None:
    """How a prefill's choice ends once its first token is out: not yet (vLLM runs its extra token), handed over
    (vLLM ended the request by its length, or its extra token was EOS: either way its blocks wait for the decode
    side), or an error inside vLLM."""
    if finish_reason is None:
        return None
    if finish_reason in (ERROR, ABORT):
        return Ending(ERROR)
    return Ending(HANDOVER, kv_transfer=kv_transfer)


def _logprob(entry, token_id: int, num_top: int, texts: TokenTexts) -> TokenLogprob:
    """vLLM's logprobs of one position (token id -> Logprob with its rank) as ours: the sampled token's, and the
    ``num_top`` most likely, most likely first."""
    top = sorted((lp.rank, tid, lp.logprob) for tid, lp in entry.items() if lp.rank is not None and lp.rank <= num_top)
    return TokenLogprob(texts.text(token_id), entry[token_id].logprob, [(texts.text(tid), v) for _, tid, v in top])
