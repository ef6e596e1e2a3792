"""Speculative decoding with a draft model: a smaller (or more quantized) model of the same tokenizer runs greedily a
few tokens ahead of each sequence, and the next step checks them all at once, as it checks prompt lookup's.

    after step k:  every sequence that speculates: the draft reads the tokens it has not seen yet (its prompt at
                   first, afterwards the tokens kept since), then runs greedily for as many drafts as the
                   sequence's budget allows (speculation.DraftBudget), all sequences in one batch a token
    step k+1:      the last token and its drafts in one chunk; verification.py keeps what the model agrees with

A draft proposed greedily is certain given the sequence, so verification's rule for a certain draft keeps a sampled
request's output distributed exactly as without drafts, and a greedy one's token for token.

The draft keeps a paged KV cache of its own (a ``ModelRunner`` of its own, with as many blocks as the engine's
pool). A sequence's draft cache holds its tokens up to those it had when its drafts were made; the positions its
drafts took are written over next time. A sequence the draft's pool cannot hold gets no drafts, never an error.
The draft reads at most ``max_tokens`` unseen tokens a step, all sequences together, as the engine's own prefill is
chunked: a long prompt is read over several steps (its sequence getting drafts once it has caught up), so that no
step waits for the draft to read it whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from switchyard.scheduler import Sequence
from switchyard.workers.engine.speculation import DraftBudget, grammar_allows, speculates
from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk


@dataclass(slots=True)
class _DraftCache:
    """One sequence's part of the draft's KV cache: its blocks, and how many of its tokens they hold."""

    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    budget: DraftBudget = field(default_factory=DraftBudget)


class DraftModel:
    """Proposes up to ``num_tokens`` drafts for each sequence it is given (``propose``), from ``runner``'s model."""

    def __init__(self, runner: ModelRunner, num_tokens: int, max_tokens: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        self.runner = runner
        self.num_tokens = num_tokens
        self.max_tokens = max_tokens  # unseen tokens read a step (the engine's max_num_batched_tokens)
        self._free = list(range(runner.num_blocks))
        self._caches: dict[str, tuple[Sequence, _DraftCache]] = {}

    def propose(self, seqs: Iterable[Sequence]) -> None:
        """Set the drafts of each of ``seqs`` that ``speculates`` and whose budget allows some (the others get
        none). A finished sequence's draft cache is given back here."""
        wanted: list[tuple[Sequence, _DraftCache, int]] = []
        for seq in seqs:
            if seq.is_finished or not speculates(seq):
                continue
            _, cache = self._caches.setdefault(seq.seq_id, (seq, _DraftCache()))
            tokens = seq.all_token_ids
            allowed = cache.budget.allowed(tokens, self.num_tokens)
            # Its tokens and every draft but the last take a position of the draft's cache.
            if allowed and self._hold(cache, len(tokens) + allowed - 1):
                wanted.append((seq, cache, allowed))
        for seq_id in [i for i, (seq, _) in self._caches.items() if seq.is_finished]:
            self._free += self._caches.pop(seq_id)[1].blocks
        if not wanted:
            return
        ready, drafts = self._run(wanted)
        for (seq, cache, _), proposed in zip(ready, drafts):
            cache.budget.proposed(seq, grammar_allows(seq, proposed))

    def _run(self, wanted: list[tuple[Sequence, _DraftCache, int]],
             ) -> tuple[list[tuple[Sequence, _DraftCache, int]], list[list[int]]]:
        """The greedy drafts of those of ``wanted`` whose unseen tokens fit this step's ``max_tokens`` (and the
        sequences they are for). Each reads its unseen tokens, whose last one's logits give its first draft, then
        one draft at a time for those allowed more. A sequence that does not fit reads what is left of the budget
        and gets no drafts this step."""
        chunks, ready, left = [], [], self.max_tokens
        for entry in wanted:
            seq, cache, _ = entry
            tokens = seq.all_token_ids
            start = min(cache.computed, len(tokens) - 1)
            unseen = len(tokens) - 1 - start  # before the last, which every ready sequence reads
            if unseen <= left:
                chunks.append(SeqChunk(tokens[start:], start, cache.blocks, True))
                cache.computed = len(tokens)
                ready.append(entry)
            elif left:
                chunks.append(SeqChunk(tokens[start : start + left], start, cache.blocks, False))
                cache.computed = start + left
            left -= min(unseen, left)
        logits = self.runner.execute(chunks) if chunks else None
        if not ready or logits is None:
            return [], []
        drafts = [[token] for token in logits.argmax(-1).tolist()]
        for n in range(1, max(allowed for _, _, allowed in ready)):
            going = [i for i, (_, _, allowed) in enumerate(ready) if allowed > n]
            chunks = [SeqChunk([drafts[i][-1]], ready[i][1].computed + n - 1, ready[i][1].blocks, True)
                      for i in going]
            for i, token in zip(going, self.runner.execute(chunks).argmax(-1).tolist()):
                drafts[i].append(token)
        return ready, drafts

    def _hold(self, cache: _DraftCache, positions: int) -> bool:
        """Whether ``cache`` has (or now gets) blocks for ``positions`` positions; False where the pool has not
        enough free."""
        needed = -(-positions // self.runner.block_size) - len(cache.blocks)
        if needed > len(self._free):
            return False
        if needed > 0:
            cache.blocks += self._free[-needed:]
            del self._free[-needed:]
        return True
