"""Whether a step speculates, by measurement. Drafts win where a decode step is bound by reading the weights (few
sequences: K + 1 rows cost about what one does) and lose where it is bound by compute (many sequences: every draft
is a row more, and a draft model's own steps come on top). Where that turns depends on the CPU, the model, the
draft and what else runs on the cores, so the worker measures it (executor/measured_choice.py):

    after step k's update ─▶ its class: the sequences it sampled, by powers of two
                          ─▶ on: the speculator proposes drafts for step k+1 (timed); off: no drafts
    step k+1, a decode of those sequences (no prompt chunk; each its last token and its drafts)
                          ─▶ cost = (proposing + the step) / tokens the step emitted, for that class and choice

Speculation starts on in every class. Each sequence's own budget (speculation.DraftBudget) already keeps one whose
drafts lose from paying for them; this is the batch's choice, made from seconds per token, so that drafts whose
acceptance is high still go where the step cannot afford them. The first step after a change is not counted: a
draft model catching up on the tokens of the steps it skipped pays for the change, not for speculating.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from switchyard.scheduler import Sequence
from switchyard.workers.executor.measured_choice import MeasuredChoice


class Speculator(Protocol):
    def propose(self, seqs: Iterable[Sequence]) -> None: ...


@dataclass(slots=True)
class _Proposal:
    num_seqs: int
    on: bool
    seconds: float
    counted: bool


# A batch size first goes without drafts this long after it is first seen, then twice as late each time: sooner than
# the thread count's first try, as a batch's size changes within seconds and drafts that lose cost a step each.
EXPLORE_EVERY_S = 1.0


class SpeculationGate:
    """Runs a speculator for the sequences a step sampled, or not, as measured (``propose``, then ``observed``)."""

    def __init__(self, speculator: Speculator, clock: Callable[[], float] = time.monotonic,
                 explore_every_s: float = EXPLORE_EVERY_S) -> None:
        self.speculator = speculator
        self._clock = clock
        self._choice: MeasuredChoice[bool] = MeasuredChoice([True, False], clock, explore_every_s)
        self._proposal: _Proposal | None = None
        self._last_on = True
        self.num_steps_off = 0  # decode steps run without drafts because they were measured faster so

    def propose(self, seqs: list[Sequence]) -> None:
        """Drafts for the next step of ``seqs`` (the sequences this step sampled), if speculating pays for their
        batch; a speculator always hears of the step, to let go of what it held for finished sequences."""
        if not seqs:
            self._proposal = None
            self.speculator.propose(())
            return
        on = self._choice.choose(len(seqs).bit_length())
        started = self._clock()
        self.speculator.propose(seqs if on else ())
        self._proposal = _Proposal(len(seqs), on, self._clock() - started, on == self._last_on)
        self._last_on = on

    def observed(self, num_seqs: int, is_decode: bool, seconds: float, num_tokens: int) -> None:
        """The step after a ``propose`` ran ``num_seqs`` sequences in ``seconds`` (``is_decode``: no prompt chunk
        among them) and emitted ``num_tokens`` tokens."""
        proposal, self._proposal = self._proposal, None
        if proposal is None or not is_decode or num_seqs != proposal.num_seqs or num_tokens <= 0:
            return
        if not proposal.on:
            self.num_steps_off += 1
        cost = (proposal.seconds + seconds) / num_tokens
        self._choice.observed(num_seqs.bit_length(), proposal.on, cost, proposal.counted)

    def speculates(self, num_seqs: int) -> bool:
        """Whether a batch of ``num_seqs`` decoding sequences gets drafts now (outside exploration)."""
        return self._choice.best(num_seqs.bit_length())
