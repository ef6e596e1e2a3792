"""The log-probabilities a request asked for: the model's own (log-softmax of the raw logits, before penalties,
temperature and grammar masks, as vLLM reports them by default), with each token's text alone."""

from __future__ import annotations

import torch

from switchyard.scheduler import Sequence
from switchyard.shared.messages import TokenLogprob
from switchyard.workers.engine.sequences import choice_of
from switchyard.workers.serving.token_texts import TokenTexts


class TokenLogprobs(TokenTexts):
    """Log-probabilities of sampled tokens and their top alternatives, for the sequences that asked for them."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], token_ids: list[int]) -> dict[str, TokenLogprob]:
        """``logits[i]`` gave ``token_ids[i]`` for ``seqs[i]``; returns seq id -> its entry, for the rows whose
        request asked for logprobs."""
        rows = [i for i, seq in enumerate(seqs) if choice_of(seq).request.params.logprobs]
        if not rows:
            return {}
        logp = torch.log_softmax(logits[rows].float(), dim=-1)
        chosen = logp.gather(1, torch.tensor([[token_ids[i]] for i in rows], device=logp.device)).view(-1).tolist()
        num_top = max(choice_of(seqs[i]).request.params.top_logprobs for i in rows)
        top_value_rows, top_id_rows = (logp.topk(num_top, dim=-1) if num_top else (logp[:, :0], logp[:, :0].long()))
        top_values: list[list[float]] = top_value_rows.tolist()
        top_ids: list[list[int]] = top_id_rows.tolist()
        out = {}
        for j, i in enumerate(rows):
            k = choice_of(seqs[i]).request.params.top_logprobs
            top = [(self.text(t), v) for t, v in zip(top_ids[j][:k], top_values[j][:k])]
            out[seqs[i].seq_id] = TokenLogprob(self.text(token_ids[i]), chosen[j], top)
        return out
