"""Speculative decoding by prompt lookup: the tokens that followed the last place the sequence's latest n-gram
appeared (in its prompt or its output) are proposed as its next tokens, and the next step checks them all at once.

    step k:    update ─▶ propose(seq): its last n tokens (n = 4, 3, 2) found earlier ─▶ the K tokens after them
    step k+1:  the last token and the K drafts in one chunk ─▶ logits of each ─▶ the drafts the model agrees with
               are kept, and the model's own token after them (at least one token a step, at most K + 1)

It pays where the output repeats its input (editing a text, quoting a document, code): a decode step reads the
weights once for K + 1 tokens. Where nothing repeats nothing is proposed and the step is a plain decode.

Which drafts are kept is verification.py's: a greedy request's output is the one decoding a token a step gives, a
sampled one's is distributed as it. Under a grammar, drafts are cut at the first the grammar forbids, and each row is
masked as the grammar stands after the drafts before it. Requests asking for logprobs decode one token a step.
"""

from __future__ import annotations

from collections.abc import Iterable

from switchyard.scheduler import Sequence
from switchyard.shared.config import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN
from switchyard.workers.engine.sequences import choice_of

MAX_PAUSE = 64  # steps: the longest a sequence whose drafts keep losing goes without any


class DraftBudget:
    """One sequence's last drafts, where they were proposed, and how many it may get next, from how those did: all
    kept, twice as many (up to the most a step checks); none kept, half as many; a single one rejected, none for 2,
    4, ... up to MAX_PAUSE steps. A draft costs a row of compute (on a CPU a step of 5 rows takes about twice one of
    1), and a sequence whose drafts keep losing should pay next to nothing for them. Every proposer keeps one per
    sequence (prompt lookup here, a draft model in draft_model.py)."""

    __slots__ = ("drafts", "proposed_at", "limit", "pause", "next_pause")

    def __init__(self) -> None:
        self.drafts: list[int] = []
        self.proposed_at = 0
        self.limit = 1  # one draft to begin with: a sequence earns more by keeping them
        self.pause = 0  # steps left without drafts
        self.next_pause = 0  # how long the next pause is

    def allowed(self, tokens: list[int], most: int) -> int:
        """How many drafts the sequence, now ``tokens`` long, may get this step (0 while paused), after judging its
        last ones against the tokens that followed them."""
        if self.drafts:
            new = tokens[self.proposed_at : self.proposed_at + len(self.drafts)]
            kept = next((i for i, (a, b) in enumerate(zip(new, self.drafts)) if a != b), len(new))
            if kept:
                self.next_pause = 0
            if kept >= len(self.drafts):
                self.limit = min(most, 2 * self.limit)
            elif kept == 0 and self.limit > 1:
                self.limit //= 2
            elif kept == 0:
                self.pause = self.next_pause = min(MAX_PAUSE, max(2, 2 * self.next_pause))
        self.drafts = []
        if self.pause:
            self.pause -= 1
            return 0
        return min(self.limit, most)

    def proposed(self, seq: Sequence, drafts: list[int]) -> None:
        """``drafts`` are ``seq``'s for the next step."""
        self.drafts = seq.draft_token_ids = drafts
        self.proposed_at = len(seq.all_token_ids)


class _Index:
    """Where each n-gram of one sequence last ended (n from PROMPT_LOOKUP_MIN to PROMPT_LOOKUP_MAX), for the
    n-grams ending before ``indexed``; kept up to date as the sequence grows (it only grows while it runs)."""

    __slots__ = ("last_end", "indexed", "budget")

    def __init__(self) -> None:
        self.last_end: dict[tuple[int, ...], int] = {}
        self.indexed = 0
        self.budget = DraftBudget()


def speculates(seq: Sequence) -> bool:
    """Whether ``seq`` may run drafts: without logprobs, past its first token, and not a prefill worker's part
    (which ends at its first token)."""
    choice = choice_of(seq)
    return choice.unreported_logprobs is None and not choice.request.handover and seq.num_output_tokens > 0


def grammar_allows(seq: Sequence, drafts: list[int]) -> list[int]:
    """``drafts`` up to the first that ``seq``'s grammar forbids (a draft it forbids cannot be kept)."""
    if drafts and (matcher := choice_of(seq).matcher) is not None:
        return drafts[:matcher.validate_tokens(drafts)]
    return drafts


class PromptLookup:
    """Proposes up to ``num_tokens`` drafts for each sequence it is given (``propose``)."""

    def __init__(self, num_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        self.num_tokens = num_tokens
        self._indexes: dict[str, tuple[Sequence, _Index]] = {}

    def propose(self, seqs: Iterable[Sequence]) -> None:
        """Set the drafts of each of ``seqs`` that ``speculates`` (the others get none). A sequence's index lives as
        long as the sequence: a finished one's is dropped here."""
        for seq in seqs:
            if seq.is_finished or not speculates(seq):
                continue
            _, index = self._indexes.setdefault(seq.seq_id, (seq, _Index()))
            tokens = seq.all_token_ids
            allowed = index.budget.allowed(tokens, self.num_tokens)
            if not allowed:
                continue
            index.budget.proposed(seq, grammar_allows(seq, self._lookup(index, tokens)[:allowed]))
        for seq_id in [i for i, (seq, _) in self._indexes.items() if seq.is_finished]:
            del self._indexes[seq_id]

    def _lookup(self, index: _Index, tokens: list[int]) -> list[int]:
        """The tokens after the latest earlier occurrence of the longest suffix of ``tokens`` found (at most
        ``num_tokens``); [] when none of its suffixes occurred before."""
        last = len(tokens) - 1
        for end in range(index.indexed, last):  # every n-gram ending before the last token
            for n in range(PROMPT_LOOKUP_MIN, min(PROMPT_LOOKUP_MAX, end + 1) + 1):
                index.last_end[tuple(tokens[end + 1 - n : end + 1])] = end
        index.indexed = max(index.indexed, last)
        for n in range(min(PROMPT_LOOKUP_MAX, len(tokens)), PROMPT_LOOKUP_MIN - 1, -1):
            found = index.last_end.get(tuple(tokens[len(tokens) - n :]))
            if found is not None:
                return tokens[found + 1 : found + 1 + self.num_tokens]
        return []
