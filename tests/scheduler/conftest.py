"""Helpers for scheduler tests: build sequences and run steps with fabricated model outputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from switchyard.scheduler import Scheduler, SchedulerOutput, Sequence


def toy_next_token(seq: Sequence) -> int:
    """A deterministic stand-in for the model: the next token depends only on the tokens so far."""
    return (seq.token_ids[-1] * 31 + seq.num_tokens) % 97


def make_sequence(
    seq_id: str,
    num_prompt_tokens: int = 8,
    max_tokens: int = 4,
    priority: int = 0,
    arrival: float = 0.0,
    prompt: list[int] | None = None,
) -> Sequence:
    if prompt is None:
        # Distinct per id, so unrelated sequences never share prefix-cache blocks by accident.
        base = sum(map(ord, seq_id)) * 1000
        prompt = [base + i for i in range(num_prompt_tokens)]
    return Sequence(seq_id, prompt, max_tokens=max_tokens, priority=priority, arrival=arrival)


def run_step(
    sched: Scheduler, next_token: Callable[[Sequence], int] = toy_next_token
) -> tuple[SchedulerOutput, list[Sequence]]:
    """schedule() then update_from_output() with a token for every entry that needs one."""
    output = sched.schedule()
    sampled = {e.seq.seq_id: next_token(e.seq) for e in output.scheduled if e.needs_sample}
    return output, sched.update_from_output(output, sampled)


@pytest.fixture
def make_seq() -> Callable[..., Sequence]:
    return make_sequence


@pytest.fixture
def step() -> Callable[..., tuple[SchedulerOutput, list[Sequence]]]:
    return run_step


def expected_outputs(prompt: list[int], num_outputs: int) -> list[int]:
    """What toy_next_token yields when a sequence is decoded without interruption."""
    seq = Sequence("ref", prompt, max_tokens=num_outputs)
    for _ in range(num_outputs):
        seq.append_token(toy_next_token(seq))
    return seq.output_token_ids


@pytest.fixture
def reference_outputs() -> Callable[[list[int], int], list[int]]:
    return expected_outputs
