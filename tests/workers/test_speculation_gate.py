"""Whether a batch speculates, chosen by measurement (workers/engine/speculation_gate.py): drafts kept where they give
more tokens a second, turned off for a batch size where proposing and checking them costs more than they give, tried
again later, and a change of the machine's conditions followed."""

from __future__ import annotations

from types import SimpleNamespace

from switchyard.workers.engine.speculation_gate import EXPLORE_EVERY_S, SpeculationGate
from switchyard.workers.executor.measured_choice import MAX_EXPLORE_EVERY_S


class Machine:
    """A fake clock and a fake speculator: a decode step of n sequences takes ``step_s(n)`` plus ``draft_row_s``
    per draft it checks, proposing takes ``propose_s`` per sequence, and each sequence keeps ``kept`` of its K
    drafts."""

    def __init__(self, step_s, draft_row_s: float, propose_s: float, kept: int = 3, k: int = 4) -> None:
        self.now = 0.0
        self.step_s, self.draft_row_s, self.propose_s, self.kept, self.k = step_s, draft_row_s, propose_s, kept, k
        self.proposed_for: list[int] = []  # batch sizes drafts were proposed for
        self._drafts = 0

    def clock(self) -> float:
        return self.now

    def propose(self, seqs) -> None:
        seqs = list(seqs)
        self._drafts = self.k * len(seqs)
        if seqs:
            self.proposed_for.append(len(seqs))
            self.now += self.propose_s * len(seqs)

    def step(self, gate: SpeculationGate, n: int) -> bool:
        """One decode step of ``n`` sequences, then the next step's proposal; whether it had drafts."""
        drafts, self._drafts = self._drafts, 0
        took = self.step_s(n) + self.draft_row_s * drafts
        self.now += took
        tokens = n + (self.kept * n if drafts else 0)
        gate.observed(n, True, took, tokens)
        gate.propose([SimpleNamespace() for _ in range(n)])
        return drafts > 0


def run(machine: Machine, gate: SpeculationGate, n: int, seconds: float) -> list[bool]:
    end, used = machine.now + seconds, []
    while machine.now < end:
        used.append(machine.step(gate, n))
    return used


def cpu_like(n: int) -> float:
    """Bound by the weights up to a few rows, by compute beyond (seconds per decode step of n sequences)."""
    return 0.010 + 0.002 * n


def test_drafts_stay_on_alone_and_go_off_in_a_batch_where_they_cost_more_than_they_give():
    machine = Machine(cpu_like, draft_row_s=0.002, propose_s=0.004)
    gate = SpeculationGate(machine, machine.clock)
    alone = run(machine, gate, 1, 60.0)
    assert gate.speculates(1) and alone.count(True) / len(alone) > 0.95
    batch = run(machine, gate, 16, 2 * EXPLORE_EVERY_S + 1.0)
    assert not gate.speculates(16)
    later = run(machine, gate, 16, 300.0)
    assert later.count(True) / len(later) < 0.05  # tried again now and then, each try a few steps
    assert gate.num_steps_off >= len(later) * 0.9 and batch[0]  # on until measured otherwise


def test_a_batch_class_follows_a_change_in_what_drafts_cost():
    machine = Machine(cpu_like, draft_row_s=0.0002, propose_s=0.0004)  # cheap drafts: on even at 16
    gate = SpeculationGate(machine, machine.clock)
    run(machine, gate, 16, 200.0)
    assert gate.speculates(16)
    machine.draft_row_s, machine.propose_s = 0.004, 0.008  # a busy neighbour, say: now they cost more than they give
    run(machine, gate, 16, MAX_EXPLORE_EVERY_S + 2 * EXPLORE_EVERY_S)
    assert not gate.speculates(16)


def test_steps_that_are_not_a_decode_of_the_proposed_batch_say_nothing():
    machine = Machine(cpu_like, draft_row_s=0.002, propose_s=0.004)
    gate = SpeculationGate(machine, machine.clock)
    for _ in range(2000):  # every step a prompt chunk among them, or a batch other than the one proposed for
        gate.propose([SimpleNamespace() for _ in range(16)])
        machine.now += 0.1
        gate.observed(16, False, 10.0, 16)
        gate.propose([SimpleNamespace() for _ in range(16)])
        gate.observed(15, True, 10.0, 15)
    assert gate.speculates(16) and gate.num_steps_off == 0


def test_no_sequence_sampled_still_lets_the_speculator_forget_finished_ones():
    machine = Machine(cpu_like, draft_row_s=0.002, propose_s=0.004)
    calls = []
    machine.propose = calls.append
    SpeculationGate(machine, machine.clock).propose([])
    assert [list(c) for c in calls] == [[]]
