"""Which drafts a step keeps (workers/engine/verification.py): greedy keeps the argmax's, and sampling keeps the
output distributed exactly as decoding one token a step, shown by a chi-square test on a small vocabulary (fixed
seeds: the test is deterministic, and fails on a rule that is off by a few percent)."""

from __future__ import annotations

import random

import pytest
import torch
from scipy.stats import chisquare

from switchyard.shared.messages import SamplingParams as P
from switchyard.workers.engine.sampling import filter_logits
from switchyard.workers.engine.verification import verify

ROW0 = torch.tensor([1.0, 0.2, 0.8, -0.5, 0.4, 0.0])  # the model's logits after the last token
ROW1 = torch.tensor([-0.3, 0.9, 0.1, 0.6, -1.0, 0.5])  # after the draft
TRIALS = 20_000


def target(row: torch.Tensor, params: P) -> torch.Tensor:
    return filter_logits(row[None], [params]).softmax(-1)[0].double()


def counts(tokens: list[int]) -> list[int]:
    return [tokens.count(t) for t in range(len(ROW0))]


def expected_counts(probs: torch.Tensor, n: int) -> list[float]:
    return (probs / probs.sum() * n).tolist()


def p_value(observed: list[int], expected: list[float]) -> float:
    """Chi-square p-value over the tokens the distribution allows (a token it excludes must not occur)."""
    assert all(o == 0 for o, e in zip(observed, expected) if e == 0)
    pairs = [(o, e) for o, e in zip(observed, expected) if e > 0]
    o, e = zip(*pairs)
    return chisquare(o, [x * sum(o) / sum(e) for x in e]).pvalue


def test_greedy_keeps_drafts_while_they_are_the_argmax():
    prepared = torch.stack([ROW0, ROW1, ROW0, ROW0, ROW1, ROW1])
    verdicts = verify(prepared, [P(temperature=0)] * 3, [None] * 3, [[0], [2], [1]])
    # ROW0's argmax is 0, ROW1's 1. First: draft 0 kept, then ROW1's 1. Second: draft 2 is not ROW0's argmax, 0
    # comes instead. Third: draft 1 is ROW1's argmax, kept, then 1 again.
    assert verdicts == [(1, 1), (0, 0), (1, 1)]


@pytest.mark.parametrize("params, draft", [
    (P(temperature=1.0), 2),  # a likely draft
    (P(temperature=0.7), 5),  # a less likely one, at another temperature
    (P(temperature=1.0, top_k=3), 3),  # outside the top 3: never kept
    (P(temperature=1.0, top_p=0.8), 0),
])
def test_sampled_output_is_distributed_as_decoding_one_token_a_step(params, draft):
    prepared = torch.stack([ROW0, ROW1] * TRIALS)
    verdicts = verify(prepared, [params] * TRIALS, [random.Random(seed) for seed in range(TRIALS)],
                      [[draft]] * TRIALS)
    first = [draft if kept else token for kept, token in verdicts]
    second = [token for kept, token in verdicts if kept]
    p0, p1 = target(ROW0, params), target(ROW1, params)
    # The first token as row 0 would draw it; the one after a kept draft as row 1 would.
    assert len(first) == TRIALS and p_value(counts(first), expected_counts(p0, TRIALS)) > 1e-3
    assert abs(len(second) / TRIALS - p0[draft].item()) < 0.02
    if second:
        assert p_value(counts(second), expected_counts(p1, len(second))) > 1e-3
    if p0[draft] == 0:
        assert not second


def test_a_rule_off_by_a_little_is_caught():
    """The test above can fail: keeping the draft with p(d) + 0.05 instead of p(d) skews the first token."""
    params = P(temperature=1.0)
    p0 = target(ROW0, params)
    rng = random.Random(0)
    skewed = []
    for _ in range(TRIALS):
        if rng.random() < p0[2].item() + 0.05:
            skewed.append(2)
        else:
            rest = p0.clone()
            rest[2] = 0
            skewed.append(int(torch.multinomial(rest.float(), 1, generator=torch.Generator().manual_seed(
                rng.randrange(2**31))).item()))
    assert p_value(counts(skewed), expected_counts(p0, TRIALS)) < 1e-3


def test_several_drafts_stop_at_the_first_rejected_and_the_rows_must_fit():
    prepared = torch.stack([ROW0, ROW0, ROW1, ROW1])
    assert verify(prepared, [P(temperature=0)], [None], [[0, 0, 1]]) == [(3, 1)]  # each its row's argmax
    assert verify(prepared, [P(temperature=0)], [None], [[0, 2, 1]]) == [(1, 0)]  # 2 is not row 1's: 0 instead
    with pytest.raises(ValueError, match="rows"):
        verify(prepared, [P(temperature=0)], [None], [[0]])
