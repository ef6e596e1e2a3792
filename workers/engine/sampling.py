"""Turn a batch of next-token logits into token ids, each row under its own request's sampling parameters.

Order, as in vLLM and HF: logit bias → penalties → grammar mask → temperature → top-k → top-p → min-p → draw.
Filtering is vectorised over the batch; only the uniforms are per row, because each seeded request owns a
``random.Random`` and must get the same tokens whatever else shares its batch.

The draw is the inverse CDF: the first token whose cumulative probability exceeds the row's uniform. The uniforms
are made on the host, so nothing here waits for the device.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from switchyard.shared.messages import SamplingParams
from switchyard.workers.executor.transfers import to_device
from switchyard.workers.serving.guided import apply_masks

# Below this temperature, sampling is greedy: dividing by it would overflow the logits to inf (then NaN).
GREEDY_TEMPERATURE = 1e-5


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]],
    output_token_ids: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Presence/frequency penalties (OpenAI: from generated tokens) and repetition penalty (HF/CTRL: from prompt
    and generated tokens) applied in place to float ``logits [B, V]``; returns ``logits``."""
    batch, vocab = logits.shape
    device = logits.device
    use_additive = any(p.presence_penalty != 0 or p.frequency_penalty != 0 for p in params)
    use_repetition = any(p.repetition_penalty != 1 for p in params)
    if not (use_additive or use_repetition):
        return logits
    columns = to_device([[p.presence_penalty, p.frequency_penalty, p.repetition_penalty] for p in params],
                        logits.dtype, device)
    presence, frequency, repetition = columns.unbind(1)

    output_counts = _token_counts(output_token_ids, batch, vocab, device)
    if use_additive:
        logits -= frequency[:, None] * output_counts
        logits -= presence[:, None] * (output_counts > 0).to(logits.dtype)
    if use_repetition:
        seen = (output_counts > 0) | (_token_counts(prompt_token_ids, batch, vocab, device) > 0)
        rep = repetition[:, None].expand_as(logits)
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """OpenAI's ``logit_bias``: each listed token's bias added to its logit, in place, before anything else
    (-100 all but bans a token, +100 all but forces it)."""
    rows, cols, values = [], [], []
    for row, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(row)
            cols.append(token)
            values.append(bias)
    if not rows:
        return
    device = logits.device
    logits.index_put_((to_device(rows, torch.long, device), to_device(cols, torch.long, device)),
                      to_device(values, logits.dtype, device), accumulate=True)


def _token_counts(token_ids: Sequence[Sequence[int]], batch: int, vocab: int, device) -> torch.Tensor:
    """``[B, V]`` float counts of each token id per row, in one scatter-add over the flattened batch.

    Not ``torch.bincount``: its output size depends on the data, so on a GPU it reads the largest id back to the
    host first, a sync in the middle of the step; a scatter into a buffer of known size queues without waiting."""
    counts = torch.zeros(batch * vocab, device=device)
    index = [row * vocab + t for row, ids in enumerate(token_ids) for t in ids]
    if index:
        counts.index_put_((to_device(index, torch.long, device),), torch.ones(len(index), device=device),
                          accumulate=True)
    return counts.view(batch, vocab)


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for the sampled (temperature > 0) rows of float ``logits [B, V]``.

    Returns logits with filtered-out entries at ``-inf``. Greedy rows pass through unchanged.
    """
    device = logits.device
    temperature = to_device([max(p.temperature, GREEDY_TEMPERATURE) for p in params], logits.dtype, device)
    logits = logits / temperature[:, None]

    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p if 0 < p.top_p < 1 else 1.0 for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        # One descending sort serves both: top-k is a rank cut, top-p a cut on the cumulative sum.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)
        cuts = to_device([top_k, top_p], torch.float32, device)
        remove = ranks[None, :] >= cuts[0, :, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first token always stays.
        mass_above = probs.cumsum(dim=-1) - probs
        remove = mass_above >= cuts[1, :, None].to(probs.dtype)
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    if any(p.min_p > 0 for p in params):
        min_p = to_device([p.min_p for p in params], logits.dtype, device)
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def prepare_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    masks: tuple[list[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A float32 copy of ``logits [B, V]`` with each row's logit bias, penalties and grammar mask applied: what
    temperature and the filters then shape into the row's distribution (``draw``). The caller's logits (its
    logprobs) stay the model's."""
    batch = logits.shape[0]
    logits = logits.to(torch.float32, copy=True)  # penalties work in place
    apply_logit_bias(logits, params)
    if prompt_token_ids is not None or output_token_ids is not None:
        empty: list[list[int]] = [[] for _ in range(batch)]
        logits = apply_penalties(logits, params, prompt_token_ids or empty, output_token_ids or empty)
    if masks is not None:
        apply_masks(logits, *masks)
    return logits


def uniforms_for(generators: Sequence[random.Random | None]) -> list[float]:
    """One uniform in [0, 1) per generator, in order: its own for a seeded request, torch's global RNG's for the
    others; capped below 1 so that in float32 ``u * total`` stays under the total (else the clamp in ``draw`` could
    pick a filtered tail)."""
    unseeded = iter(torch.rand(sum(g is None for g in generators), dtype=torch.float64).tolist())
    return [min(next(unseeded) if g is None else g.random(), 1 - 2**-20) for g in generators]


def draw(logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[random.Random | None],
         ) -> torch.Tensor:
    """One token per row of prepared ``logits`` (``prepare_logits``): argmax for greedy rows, else a draw from the
    row's distribution after temperature, top-k, top-p and min-p, by the inverse CDF of a host-made uniform."""
    batch = logits.shape[0]
    sampled_rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_TEMPERATURE]
    if not sampled_rows:
        return logits.argmax(dim=-1)
    rows = None if len(sampled_rows) == batch else to_device(sampled_rows, torch.long, logits.device)
    chosen = logits if rows is None else logits.index_select(0, rows)
    picked = draw_filtered(filter_logits(chosen, [params[i] for i in sampled_rows]),
                           [generators[i] for i in sampled_rows])
    return picked if rows is None else logits.argmax(dim=-1).index_copy_(0, rows, picked)


def draw_filtered(filtered: torch.Tensor, generators: Sequence[random.Random | None]) -> torch.Tensor:
    """One token per row of ``filtered`` logits (``filter_logits``'s: temperature applied, filtered-out tokens at
    -inf), by the inverse CDF of a uniform from the row's generator."""
    cdf = filtered.softmax(dim=-1).cumsum_(dim=-1)
    # u scaled by the row's total mass (1 up to rounding): the first token whose cumulative mass exceeds it. A
    # filtered-out token adds no mass, so it is never the first to exceed anything.
    targets = to_device(uniforms_for(generators), torch.float32, filtered.device)[:, None] * cdf[:, -1:]
    return torch.searchsorted(cdf, targets, right=True).view(-1).clamp_max_(cdf.shape[1] - 1)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[random.Random | None],
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
    masks: tuple[list[int], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits [B, V]``; returns a ``[B]`` long tensor on the logits' device.

    ``params[i]`` and ``generators[i]`` belong to row ``i``; a ``None`` generator draws from torch's global CPU
    RNG. ``temperature == 0`` (anything below ``GREEDY_TEMPERATURE``) is greedy: argmax after penalties. Token
    histories are needed only for penalties. ``masks``: the rows under a grammar and their allowed tokens
    (guided.fill_masks), every other token of those rows excluded. Nothing here waits for the device.
    """
    batch = logits.shape[0]
    if not (len(params) == len(generators) == batch):
        raise ValueError(f"{batch} logit rows but {len(params)} params and {len(generators)} generators")
    return draw(prepare_logits(logits, params, prompt_token_ids, output_token_ids, masks), params, generators)
