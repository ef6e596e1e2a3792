"""What a sampled token means for its request, as the deltas its client gets.

    Engine.step ─▶ scheduler.update_from_output ─▶ on_tokens(seq, n) for each sequence with new tokens:
        EOS (unless ignored) · a stop string · max_tokens or the context · a complete grammar · the output filter
        · a prefill worker's first token (``handover``: the rest is a decode worker's)
        ─▶ the scheduler ends the sequence ─▶ finish(): its last delta, the request's usage on it
        otherwise ─▶ the detokenized text (held back while it may still turn out a stop string or a tool tag) ─▶ a
        delta, or nothing yet

A request's choices are counted here: the last choice to finish carries ``is_last`` and the whole request's usage,
and ends the request in the engine's table. No I/O: the engine's step calls it.
"""

from __future__ import annotations

from switchyard.scheduler import RequestStatus, Scheduler, Sequence, finish_reason
from switchyard.shared.messages import HANDOVER, ErrorInfo, TokenDelta, Usage
from switchyard.workers.engine.sequences import choice_of
from switchyard.workers.serving.choice import RequestState


class Deltas:
    """Turns sequences' new tokens into their clients' deltas (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, eos: frozenset[int], requests: dict[str, RequestState]) -> None:
        """``eos``: the model's end-of-sequence token ids; ``requests``: the engine's table of running requests
        (a request's last delta removes it)."""
        self.scheduler = scheduler
        self._eos = eos
        self._requests = requests

    def on_tokens(self, seq: Sequence, num_new: int = 1) -> TokenDelta | None:
        """``seq`` has ``num_new`` new tokens (the scheduler appended them; more than one where drafts were kept):
        end it where it ends (EOS, a stop string, its length, a complete grammar, the output filter), forgetting
        any token after that, and return what its client gets now, if anything."""
        choice = choice_of(seq)
        if choice.request.held:  # choice 0's prompt is in the cache now: the other choices can share it
            for held in choice.request.held:
                self.scheduler.add_request(held)
            choice.request.held.clear()
        params = choice.request.params
        first = seq.num_tokens - num_new
        text = ""
        for position in range(first, first + num_new):
            token_id = seq.token_ids[position]
            choice.num_unreported_tokens += 1
            if token_id not in self._eos:
                choice.follow_grammar(token_id)
            if token_id in self._eos and not params.ignore_eos:
                if choice.unreported_logprobs:  # the EOS token ends the text; it is not part of it
                    choice.unreported_logprobs.pop()
                return self._stop(seq, position, text + choice.detokenizer.flush())
            text += choice.detokenizer.add_token(token_id)
            if choice.detokenizer.is_stopped:
                return self._stop(seq, position, text)
            if position == first + num_new - 1 and seq.is_finished:  # the scheduler ended it: max_tokens or context
                return self.finish(seq, finish_reason(seq.status) or "length",
                                   choice.emittable(text + choice.detokenizer.flush()))
            if choice.grammar_is_complete:  # nothing may follow
                return self._stop(seq, position, text + choice.detokenizer.flush())
        text, calls, halted = choice.outgoing(choice.emittable(text))
        if halted:  # flagged by the output filter under a block policy: nothing more goes out, its seat freed now
            self.scheduler.finish_request(seq.seq_id, RequestStatus.FINISHED_FILTERED)
            return self.finish(seq, "content_filter", "")
        if choice.request.handover:  # a prefill worker's part ends here: a decode worker goes on from this token
            self.scheduler.finish_request(seq.seq_id, RequestStatus.FINISHED_STOPPED)  # its blocks stay cached
            return self.finish(seq, HANDOVER, text)
        if not text and not calls:
            return None  # held back (split character, possible stop string or tool tag): nothing worth a message
        return self._delta(seq, text, tool_calls=calls or None)

    def _stop(self, seq: Sequence, position: int, text: str) -> TokenDelta:
        """``seq`` stops at its token at ``position`` (EOS, a stop string, a complete grammar): the tokens after it
        were never the output."""
        seq.drop_tokens_after(position + 1)
        self.scheduler.finish_request(seq.seq_id, RequestStatus.FINISHED_STOPPED)
        return self.finish(seq, "stop", choice_of(seq).emittable(text))

    def _delta(self, seq: Sequence, text: str, reason: str | None = None, usage: Usage | None = None,
               error: ErrorInfo | None = None, tool_calls: list | None = None) -> TokenDelta:
        choice = choice_of(seq)
        num_tokens = choice.num_unreported_tokens
        delta = TokenDelta(choice.request.request_id, text=text, num_tokens=num_tokens,
                           index=choice.index, finish_reason=reason, usage=usage,
                           logprobs=choice.unreported_logprobs or None, error=error, tool_calls=tool_calls,
                           token_ids=seq.token_ids[len(seq.token_ids) - num_tokens:] if num_tokens else None)
        choice.num_unreported_tokens = 0
        if choice.unreported_logprobs:
            choice.unreported_logprobs = []
        return delta

    def finish(self, seq: Sequence, reason: str, text: str, error: ErrorInfo | None = None) -> TokenDelta:
        """``seq``'s final delta (``reason``, the rest of its ``text``), with its request's usage; the request's
        last one also ends the request here."""
        choice = choice_of(seq)
        calls = None
        if reason != HANDOVER:  # a handed-over choice is not at its end: the decode worker's filter and parser go on
            text, calls, reason = choice.final(text, reason)
        state = choice.request
        state.num_finished += 1
        state.completion_tokens += seq.num_output_tokens
        state.cached_tokens = max(state.cached_tokens, seq.num_cached_tokens)
        # Usage so far on every choice's final; the request's last (the one place its choices are counted) has
        # the request's total.
        delta = self._delta(seq, text, reason, state.usage(), error, tool_calls=calls or None)
        if state.num_finished == len(state.seq_ids):
            self._requests.pop(state.request_id, None)
            delta.is_last = True
        return delta
