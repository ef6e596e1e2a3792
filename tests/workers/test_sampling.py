"""Sampling: greedy, filters, seeded reproducibility and penalties on hand-made logits."""

from __future__ import annotations

import math

import pytest
import torch

from switchyard.shared.messages import SamplingParams
from switchyard.workers.engine.sampling import apply_penalties, filter_logits, sample
from switchyard.workers.serving.choice import make_generator

P = SamplingParams


def logits_of(probs: list[float]) -> torch.Tensor:
    return torch.tensor([probs]).log()


def test_temperature_zero_is_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    out = sample(logits, [P(temperature=0)] * 6, [None] * 6)
    assert out.tolist() == logits.argmax(-1).tolist()


def test_top_k_one_equals_greedy_whatever_the_temperature():
    logits = torch.randn(8, 1000, generator=torch.Generator().manual_seed(1))
    params = [P(temperature=t, top_k=1) for t in (0.1, 0.5, 1.0, 2.0, 5.0, 1.0, 1.0, 1.0)]
    out = sample(logits, params, [make_generator(i) for i in range(8)])
    assert out.tolist() == logits.argmax(-1).tolist()


def test_tiny_top_p_and_tiny_temperature_are_greedy():
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(2))
    params = [P(top_p=1e-6), P(top_p=1e-6, temperature=3.0), P(temperature=1e-7), P(temperature=1e-3, seed=5)]
    out = sample(logits, params, [make_generator(i) for i in range(4)])
    assert out.tolist() == logits.argmax(-1).tolist()


def test_filters_keep_the_expected_tokens():
    logits = logits_of([0.5, 0.3, 0.15, 0.05]).repeat(4, 1)
    params = [P(top_k=2), P(top_p=0.7), P(min_p=0.25), P(top_p=0.81)]
    kept = filter_logits(logits, params).isfinite().tolist()
    assert kept[0] == [True, True, False, False]  # two best
    assert kept[1] == [True, True, False, False]  # 0.5 + 0.3 reach 0.7
    assert kept[2] == [True, True, True, False]  # >= 0.25 * 0.5
    assert kept[3] == [True, True, True, False]  # 0.8 < 0.81, so the third stays


def test_filters_work_on_shuffled_vocabularies():
    # Sorting must be undone: the kept set is by value, wherever the token sits in the vocabulary.
    probs = torch.tensor([0.05, 0.3, 0.15, 0.5])
    kept = filter_logits(probs.log()[None], [P(top_k=2)]).isfinite()[0].tolist()
    assert kept == [False, True, False, True]


def test_sampled_frequencies_follow_the_distribution():
    probs = [0.6, 0.25, 0.1, 0.05]
    n = 4000
    gen = make_generator(0)
    out = sample(logits_of(probs).repeat(n, 1), [P(temperature=1.0)] * n, [gen] * n)
    freq = torch.bincount(out, minlength=4).float() / n
    for f, p in zip(freq.tolist(), probs):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / n) + 1e-3


def test_temperature_sharpens_and_flattens():
    probs = [0.6, 0.25, 0.1, 0.05]
    n = 3000

    def top_share(temperature: float) -> float:
        out = sample(logits_of(probs).repeat(n, 1), [P(temperature=temperature)] * n, [make_generator(7)] * n)
        return (out == 0).float().mean().item()

    assert top_share(0.3) > 0.9 > 0.6 + 0.05 > top_share(1.0) > 0.6 - 0.05 > top_share(5.0)


def test_filtered_tokens_are_never_sampled():
    n = 2000
    out = sample(logits_of([0.5, 0.3, 0.15, 0.05]).repeat(n, 1), [P(temperature=1.5, top_p=0.7)] * n,
                 [make_generator(3)] * n)
    assert set(out.tolist()) == {0, 1}


def test_seeded_rows_do_not_depend_on_their_batch():
    vocab = 500
    row = torch.randn(1, vocab, generator=torch.Generator().manual_seed(4))
    seeded = P(temperature=1.0, top_k=50, top_p=0.95, seed=42)

    def draws(batch_logits: torch.Tensor, params: list[SamplingParams], seeded_row: int) -> list[int]:
        gens = [make_generator(p.seed) for p in params]
        return [sample(batch_logits, params, gens)[seeded_row].item() for _ in range(20)]

    alone = draws(row, [seeded], 0)
    noise = torch.randn(3, vocab)
    batch = torch.cat([noise[:2], row, noise[2:]])
    params = [P(temperature=0.7), P(temperature=0), seeded, P(temperature=1.2, min_p=0.1, seed=1)]
    assert draws(batch, params, 2) == alone
    assert len(set(alone)) > 1  # it really samples
    assert draws(row, [P(temperature=1.0, top_k=50, top_p=0.95, seed=43)], 0) != alone


def test_unseeded_rows_use_the_global_rng():
    logits = torch.zeros(1, 1000)
    torch.manual_seed(0)
    first = [sample(logits, [P()], [None]).item() for _ in range(5)]
    torch.manual_seed(0)
    assert [sample(logits, [P()], [None]).item() for _ in range(5)] == first


def test_sample_does_not_modify_the_callers_logits():
    logits = torch.randn(2, 50)
    before = logits.clone()
    sample(logits, [P(frequency_penalty=1.0, repetition_penalty=1.5), P(top_k=3)], [None, None],
           prompt_token_ids=[[1, 2], [3]], output_token_ids=[[4, 4], []])
    assert torch.equal(logits, before)


def test_presence_and_frequency_penalties_use_generated_tokens_only():
    logits = torch.zeros(2, 6)
    params = [P(presence_penalty=0.5, frequency_penalty=0.25), P()]
    out = apply_penalties(logits, params, prompt_token_ids=[[5, 5], [1]], output_token_ids=[[1, 1, 1, 3], [2]])
    assert out[0].tolist() == pytest.approx([0, -(0.5 + 0.75), 0, -(0.5 + 0.25), 0, 0])
    assert out[1].tolist() == [0] * 6  # no penalties for that row


def test_repetition_penalty_uses_prompt_and_generated_tokens():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 2.0]])
    out = apply_penalties(logits, [P(repetition_penalty=2.0)], prompt_token_ids=[[0, 1]], output_token_ids=[[3]])
    assert out[0].tolist() == [1.0, -4.0, 2.0, -4.0, 2.0]


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.5, 0.0]])
    assert sample(logits, [P(temperature=0)], [None], output_token_ids=[[0]]).item() == 0
    params = [P(temperature=0, frequency_penalty=1.0)]
    assert sample(logits, params, [None], prompt_token_ids=[[]], output_token_ids=[[0]]).item() == 1


def test_mismatched_lengths_are_a_programming_error():
    with pytest.raises(ValueError):
        sample(torch.zeros(2, 5), [P()], [None])
