"""A step's logits to the tokens it gives, each row under its request's parameters, grammar and drafts.

    logits of the entries that sample ──▶ prepare: logit bias, penalties, grammar masks (sampling.prepare_logits)
        no drafts in the step ──▶ draw one token a row (sampling.draw): the step's one wait for the device
        drafts ──▶ a row per draft and one after them, each prepared with the drafts before it as its output so
                   far (penalties count them) and masked as its grammar stands past them ──▶ verification.verify:
                   the drafts kept and the token after them
    ──▶ the model's logprobs of each chosen token, for the requests that ask (before any mask or penalty)

No I/O and no engine state: ``Engine._compute`` calls it with the step's logits.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from switchyard.scheduler import ScheduledSeq, Sequence
from switchyard.shared.messages import TokenLogprob
from switchyard.workers.engine.logprobs import TokenLogprobs
from switchyard.workers.engine.sampling import draw, prepare_logits
from switchyard.workers.engine.sequences import choice_of
from switchyard.workers.engine.verification import verify
from switchyard.workers.executor.transfers import to_host_list
from switchyard.workers.serving.guided import fill_masks, fill_masks_along


@dataclass(slots=True)
class StepTokens:
    """What a step's sampling gave: per sequence the token after its kept drafts, the drafts kept, the logprobs
    asked for; and how many drafts it checked and kept in all."""

    sampled: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    num_drafts: int = 0
    num_kept: int = 0

    def update(self, other: StepTokens) -> None:
        """Take ``other``'s sequences in too (a step computed sequence by sequence)."""
        self.sampled.update(other.sampled)
        self.accepted.update(other.accepted)
        self.logprobs.update(other.logprobs)
        self.num_drafts += other.num_drafts
        self.num_kept += other.num_kept


def next_tokens(logits: torch.Tensor, entries: list[ScheduledSeq], logprobs: TokenLogprobs) -> StepTokens:
    """The tokens of ``entries`` (the step's entries that sample, their rows of ``logits`` in order: one each, and
    one more per draft)."""
    if not entries:
        return StepTokens()
    seqs = [e.seq for e in entries]
    choices = [choice_of(seq) for seq in seqs]
    if not any(e.draft_token_ids for e in entries):
        prepared = _prepare(logits, seqs, [seq.output_token_ids for seq in seqs])
        token_ids: list[int] = to_host_list(draw(prepared, [c.request.params for c in choices],
                                                 [c.generator for c in choices]))
        return StepTokens(dict(zip((seq.seq_id for seq in seqs), token_ids)), {}, logprobs(logits, seqs, token_ids))
    rows = [(e.seq, e.draft_token_ids[:i]) for e in entries for i in range(len(e.draft_token_ids) + 1)]
    masks = None
    guided = [(j, c.matcher) for j, c in enumerate(choices) if c.matcher is not None]
    if guided:
        starts = list(itertools.accumulate((len(e.draft_token_ids) + 1 for e in entries), initial=0))
        masks = ([starts[j] + i for j, _ in guided for i in range(len(entries[j].draft_token_ids) + 1)],
                 fill_masks_along([m for _, m in guided], [entries[j].draft_token_ids for j, _ in guided],
                                  logits.shape[1], logits.is_cuda))
    prepared = _prepare(logits, [seq for seq, _ in rows], [seq.output_token_ids + d for seq, d in rows], masks)
    verdicts = verify(prepared, [c.request.params for c in choices], [c.generator for c in choices],
                      [e.draft_token_ids for e in entries])
    tokens = StepTokens()
    final_rows: list[int] = []
    row = 0
    for e, (kept, token) in zip(entries, verdicts):
        tokens.sampled[e.seq.seq_id] = token
        tokens.accepted[e.seq.seq_id] = e.draft_token_ids[:kept]
        tokens.num_drafts += len(e.draft_token_ids)
        tokens.num_kept += kept
        final_rows.append(row + kept)
        row += len(e.draft_token_ids) + 1
    if any(c.request.params.logprobs for c in choices):
        tokens.logprobs = logprobs(logits[final_rows], seqs, [tokens.sampled[seq.seq_id] for seq in seqs])
    return tokens


def _prepare(logits: torch.Tensor, seqs: list[Sequence], outputs: list[list[int]],
             masks: tuple[list[int], torch.Tensor] | None = None) -> torch.Tensor:
    """``logits`` with each row's bias, penalties (``seqs[i]``'s output so far being ``outputs[i]``) and grammar
    mask applied; ``masks``: the rows' masks where they were made already (drafts), else each grammar's now."""
    choices = [choice_of(seq) for seq in seqs]
    matchers = {i: c.matcher for i, c in enumerate(choices) if c.matcher is not None}
    if matchers and masks is None:  # computed while the device still runs the forward (its kernels only queued)
        masks = (list(matchers), fill_masks(list(matchers.values()), logits.shape[1], logits.is_cuda))
    return prepare_logits(logits, [c.request.params for c in choices],
                          prompt_token_ids=[seq.prompt_token_ids for seq in seqs], output_token_ids=outputs,
                          masks=masks)
