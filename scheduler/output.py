"""What one step runs: the scheduler's plan, which the engine turns into one forward and hands back with the sampled
tokens (``Scheduler.update_from_output``)."""

from __future__ import annotations

from dataclasses import dataclass, field

from switchyard.scheduler.request import Sequence


@dataclass(slots=True)
class ScheduledSeq:
    """One sequence's share of a step: compute tokens ``[start_pos, start_pos + num_new_tokens)``."""

    seq: Sequence
    num_new_tokens: int
    start_pos: int  # seq.num_computed_tokens before the step
    block_table: list[int]  # the sequence's block ids, a copy the engine may keep
    needs_sample: bool  # this chunk reaches the last token, so its logits give the next token
    # Draft tokens computed after the last one (speculative decoding; counted in num_new_tokens): each row's logits
    # check the draft that follows it.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def token_ids(self) -> list[int]:
        """The tokens this step computes: a slice of the sequence's tokens, then its drafts."""
        if not self.draft_token_ids:
            return self.seq.token_ids[self.start_pos : self.start_pos + self.num_new_tokens]
        end = self.start_pos + self.num_new_tokens - len(self.draft_token_ids)
        return self.seq.token_ids[self.start_pos : end] + self.draft_token_ids


@dataclass(slots=True)
class SchedulerOutput:
    """What one step runs: running sequences first, then newly admitted ones."""

    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    num_batched_tokens: int = 0
    is_background_only: bool = False  # every scheduled sequence is background work

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
