"""Which drafts a step keeps, and the token after them: the output is distributed exactly as decoding one token a
step would give it.

A sequence with drafts d0 .. dk-1 ran rows r0 .. rk (speculation.py): row i's distribution p_i is the model's
next-token distribution after the tokens before d_i, shaped by the request's parameters (bias, penalties counting
the drafts before it, temperature, top-k, top-p, min-p). A prompt-lookup draft is certain (its proposal
distribution is all on d_i), so speculative sampling's rule reduces to:

    greedy         keep d_i while it is row i's argmax; the token after is the argmax of the first row not kept
    temperature    keep d_i with probability p_i(d_i) (a uniform u < p_i(d_i)); at the first one not kept, draw from
                   p_i without d_i, renormalised (the residual max(0, p_i - q_i)); all kept: draw from p_k

A seeded request's uniforms come from its own generator, in order, so its output is the same whatever shares the
batch; it differs from the same seed decoded without drafts (the uniforms are spent differently).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from switchyard.shared.messages import SamplingParams
from switchyard.workers.engine.sampling import GREEDY_TEMPERATURE, draw_filtered, filter_logits, uniforms_for
from switchyard.workers.executor.transfers import to_device, to_host_list


def verify(prepared: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[random.Random | None],
           drafts: Sequence[Sequence[int]]) -> list[tuple[int, int]]:
    """For each sequence ``j`` (its rows consecutive in ``prepared``, ``len(drafts[j]) + 1`` of them, from
    ``sampling.prepare_logits``; ``params[j]`` and ``generators[j]`` its request's): how many of its drafts are
    kept and the token after them."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    if row != prepared.shape[0]:
        raise ValueError(f"{prepared.shape[0]} rows for drafts that need {row}")
    greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
    argmax = prepared.argmax(dim=-1)
    # Each sampled sequence's draft rows: the probability its row gives the draft.
    checked = [(starts[j] + i, token) for j, d in enumerate(drafts) if not greedy[j] for i, token in enumerate(d)]
    if checked:
        rows = to_device([r for r, _ in checked], torch.long, prepared.device)
        probs = filter_logits(prepared.index_select(0, rows), [params[j] for j in _owners(checked, starts)]
                              ).softmax(dim=-1)
        chance = probs.gather(1, to_device([[t] for _, t in checked], torch.long, prepared.device)).view(-1)
        host = to_host_list(torch.cat([argmax.float(), chance]))  # one wait for the device
        argmax_ids, chances = [int(x) for x in host[: prepared.shape[0]]], host[prepared.shape[0]:]
    else:
        argmax_ids, chances = to_host_list(argmax), []
    results: list[tuple[int, int]] = []
    finals: list[tuple[int, int, int | None]] = []  # sampled sequences: (sequence, final row, token it excludes)
    next_chance = 0
    for j, d in enumerate(drafts):
        start, kept = starts[j], 0
        if greedy[j]:
            while kept < len(d) and d[kept] == argmax_ids[start + kept]:
                kept += 1
            results.append((kept, argmax_ids[start + kept]))
            continue
        mine = chances[next_chance : next_chance + len(d)]
        next_chance += len(d)
        for chance in mine:
            if uniforms_for([generators[j]])[0] >= chance:
                break
            kept += 1
        results.append((kept, -1))
        finals.append((j, start + kept, d[kept] if kept < len(d) else None))
    if finals:
        rows = to_device([r for _, r, _ in finals], torch.long, prepared.device)
        # Filtered with the rejected draft still in (its row's distribution is p_i as decoding would see it), then
        # the draft's mass taken out: the residual, renormalised by the draw.
        last = filter_logits(prepared.index_select(0, rows), [params[j] for j, _, _ in finals])
        excluded = [(i, t) for i, (_, _, t) in enumerate(finals) if t is not None]
        if excluded:
            last[to_device([i for i, _ in excluded], torch.long, prepared.device),
                 to_device([t for _, t in excluded], torch.long, prepared.device)] = float("-inf")
        tokens = to_host_list(draw_filtered(last, [generators[j] for j, _, _ in finals]))
        for (j, _, _), token in zip(finals, tokens):
            results[j] = (results[j][0], token)
    return results


def _owners(checked: list[tuple[int, int]], starts: list[int]) -> list[int]:
    """The sequence each checked row belongs to (rows ascending, sequences' rows consecutive)."""
    owners, j = [], 0
    for row, _ in checked:
        while j + 1 < len(starts) and starts[j + 1] <= row:
            j += 1
        owners.append(j)
    return owners
