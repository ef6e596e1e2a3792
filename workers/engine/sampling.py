"""Turn a batch of next-token logits into token ids, each row under its own request's sampling parameters.

Order, as in vLLM and HF: penalties → temperature → top-k → top-p → min-p → draw. Filtering is vectorised over
the batch; only the random draw runs per row, because each seeded request owns a ``torch.Generator`` and must get
the same tokens whatever else shares its batch.

The draw is an exponential race: ``argmax(p / E)`` with ``E ~ Exp(1)`` i.i.d. per vocabulary entry picks token
``i`` with probability ``p_i``. It needs one noise vector per row (drawn from that row's generator, in vocabulary
order, so filtering other tokens never shifts the noise of the kept ones) and no cumulative sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from switchyard.shared.messages import SamplingParams

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
    presence = torch.tensor([p.presence_penalty for p in params], dtype=logits.dtype, device=device)
    frequency = torch.tensor([p.frequency_penalty for p in params], dtype=logits.dtype, device=device)
    repetition = torch.tensor([p.repetition_penalty for p in params], dtype=logits.dtype, device=device)
    use_additive = bool((presence != 0).any() or (frequency != 0).any())
    use_repetition = bool((repetition != 1).any())
    if not (use_additive or use_repetition):
        return logits

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


def _token_counts(token_ids: Sequence[Sequence[int]], batch: int, vocab: int, device) -> torch.Tensor:
    """``[B, V]`` float counts of each token id per row, in one bincount over the flattened batch."""
    lengths = [len(ids) for ids in token_ids]
    if sum(lengths) == 0:
        return torch.zeros(batch, vocab, device=device)
    flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.long, device=device)
    rows = torch.repeat_interleave(torch.arange(batch, device=device), torch.tensor(lengths, device=device))
    return torch.bincount(rows * vocab + flat, minlength=batch * vocab).view(batch, vocab).float()


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for the sampled (temperature > 0) rows of float ``logits [B, V]``.

    Returns logits with filtered-out entries at ``-inf``. Greedy rows pass through unchanged.
    """
    device = logits.device
    temperature = torch.tensor([max(p.temperature, GREEDY_TEMPERATURE) for p in params], device=device)
    logits = logits / temperature[:, None].to(logits.dtype)

    vocab = logits.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p if 0 < p.top_p < 1 else 1.0 for p in params]
    if any(k < vocab for k in top_k) or any(p < 1.0 for p in top_p):
        # One descending sort serves both: top-k is a rank cut, top-p a cut on the cumulative sum.
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)
        remove = ranks[None, :] >= torch.tensor(top_k, device=device)[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already reach top_p; the first token always stays.
        mass_above = probs.cumsum(dim=-1) - probs
        remove = mass_above >= torch.tensor(top_p, device=device, dtype=probs.dtype)[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    min_p = torch.tensor([p.min_p for p in params], device=device, dtype=logits.dtype)
    if bool((min_p > 0).any()):
        probs = logits.softmax(dim=-1)
        threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    prompt_token_ids: Sequence[Sequence[int]] | None = None,
    output_token_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """Pick one token per row of ``logits [B, V]``; returns a ``[B]`` long tensor on the logits' device.

    ``params[i]`` and ``generators[i]`` belong to row ``i``; a ``None`` generator draws from torch's global RNG.
    ``temperature == 0`` (anything below ``GREEDY_TEMPERATURE``) is greedy: argmax after penalties. Token
    histories are needed only for penalties.
    """
    batch = logits.shape[0]
    if not (len(params) == len(generators) == batch):
        raise ValueError(f"{batch} logit rows but {len(params)} params and {len(generators)} generators")
    logits = logits.to(torch.float32, copy=True)  # penalties work in place; the caller's logits stay untouched
    if prompt_token_ids is not None or output_token_ids is not None:
        empty: list[list[int]] = [[] for _ in range(batch)]
        logits = apply_penalties(logits, params, prompt_token_ids or empty, output_token_ids or empty)

    greedy = [p.temperature < GREEDY_TEMPERATURE for p in params]
    tokens = logits.argmax(dim=-1)
    if all(greedy):
        return tokens

    sampled_rows = [i for i, g in enumerate(greedy) if not g]
    rows = torch.tensor(sampled_rows, device=logits.device)
    probs = filter_logits(logits[rows], [params[i] for i in sampled_rows]).softmax(dim=-1)
    noise = torch.empty_like(probs)
    for j, i in enumerate(sampled_rows):
        noise[j].exponential_(generator=generators[i])
    # Exp(1) may return exactly 0 in float32; the clamp keeps p / E finite and still favours that token.
    tokens[rows] = (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)
    return tokens


def make_generator(seed: int | None, device: str | torch.device = "cpu") -> torch.Generator | None:
    """A generator for a seeded request, ``None`` (the global RNG) for an unseeded one."""
    if seed is None:
        return None
    return torch.Generator(device=device).manual_seed(seed)
