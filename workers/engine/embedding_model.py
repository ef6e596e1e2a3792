"""A sentence-embedding model on the device: a Hugging Face encoder (BERT and kin) and the pooling its
sentence-transformers configuration names, so its vectors are the reference implementation's.

    token ids (ragged) ─▶ by length, into forwards (plan_forwards: least padding + per-forward cost) ─▶ padded
                          batch + attention mask ─▶ encoder ─▶ pooling (mean | cls | max) ─▶ L2 normalize?

Read from the model directory: ``modules.json`` (a ``Normalize`` module means unit vectors), ``1_Pooling/config.json``
(the pooling mode) and ``sentence_bert_config.json`` (``max_seq_length``: the longest input the model was trained
for; a longer one is refused, where the reference would cut it silently). Without them: mean pooling, normalized,
and the encoder's position limit.

Its inputs (``EmbeddingInputs``, workers/serving/embedding_inputs.py) are shared with the vLLM engine's embedder
(workers/vllm_engine/embedder.py), which runs the same directory through vLLM's pooling runner instead.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from switchyard.workers.serving.embedding_inputs import EmbeddingInputs, max_input_tokens, read_json

log = logging.getLogger("switchyard.worker")

# How a step's inputs are cut into forwards (``plan_forwards``). A forward pads its inputs to its longest, and
# costs about a fixed part plus its padded tokens (the same per padded token however many there are: no cache
# cliff); the fixed part is worth about FORWARD_COST_TOKENS padded tokens. So length-sorted inputs are cut where
# the padding saved is worth more than another forward; 16 inputs of 4-60 words pad about half their tokens in one
# forward. FORWARD_TOKENS bounds a forward's memory (activations and attention grow with it), not its speed.
FORWARD_COST_TOKENS = 32
FORWARD_TOKENS = 4096


def plan_forwards(lengths: list[int], forward_cost: int = FORWARD_COST_TOKENS,
                  max_tokens: int = FORWARD_TOKENS) -> list[list[int]]:
    """Indexes of ``lengths`` in forwards: shortest first, cut where the padded tokens plus ``forward_cost`` a
    forward are fewest (exact, by dynamic programming over the sorted order: a step holds at most a few hundred
    inputs), each forward within ``max_tokens`` padded tokens (an input longer than that runs alone)."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0] + [float("inf")] * n  # best[j]: the cost of the first j sorted inputs
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        longest = lengths[order[j - 1]]
        for i in range(j - 1, -1, -1):  # the forward holding sorted inputs i..j-1, padded to the j-1th
            if j - i > 1 and (j - i) * longest > max_tokens:
                break
            cost = best[i] + forward_cost + (j - i) * longest
            if cost < best[j]:
                best[j], cut[j] = cost, i
    forwards, j = [], n
    while j > 0:
        forwards.append(order[cut[j]:j])
        j = cut[j]
    return forwards[::-1]


class EmbeddingModel(EmbeddingInputs):
    """Encodes batches of token id lists into vectors; touched from the step thread only."""

    def __init__(self, encoder, tokenizer, pooling: str = "mean", normalize: bool = True,
                 max_tokens: int = 512) -> None:
        super().__init__(tokenizer, max_tokens)
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = normalize
        self.dimensions = encoder.config.hidden_size
        self.device = next(encoder.parameters()).device
        self.pad_id = tokenizer.pad_token_id or 0

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> EmbeddingModel:
        """The model in ``path`` (never the network), in float32: the vectors must match the reference's."""
        from transformers import AutoModel, AutoTokenizer

        path = Path(path)
        encoder = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        modules = read_json(path / "modules.json") or []
        pooling_dir = next((m["path"] for m in modules if m.get("type", "").endswith(".Pooling")), "1_Pooling")
        pooling_cfg = read_json(path / pooling_dir / "config.json") or {}
        pooling = ("cls" if pooling_cfg.get("pooling_mode_cls_token") else
                   "max" if pooling_cfg.get("pooling_mode_max_tokens") else "mean")
        normalize = not modules or any(m.get("type", "").endswith(".Normalize") for m in modules)
        max_tokens = max_input_tokens(path) or encoder.config.max_position_embeddings
        log.info("embedding model %s: %d dimensions, %s pooling%s, inputs up to %d tokens", path.name,
                 encoder.config.hidden_size, pooling, ", normalized" if normalize else "", max_tokens)
        return cls(encoder, tokenizer, pooling, normalize, max_tokens)

    @property
    def device_type(self) -> str:
        return self.device.type

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """Vectors of ``batch`` (float32 [len(batch), dimensions], in its order), in the forwards ``plan_forwards``
        cuts."""
        out = np.empty((len(batch), self.dimensions), dtype=np.float32)
        for forward in plan_forwards([len(ids) for ids in batch]):
            out[forward] = self.encode([batch[i] for i in forward]).numpy()
        return out

    @torch.inference_mode()
    def encode(self, batch: list[list[int]]) -> torch.Tensor:
        """One forward over ``batch`` (padded to its longest); returns a float32 [len(batch), dimensions] CPU
        tensor."""
        longest = max(len(ids) for ids in batch)
        input_ids = torch.full((len(batch), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), longest), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, :len(ids)] = torch.tensor(ids, dtype=torch.long)
            mask[i, :len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.encoder(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()
        if self.pooling == "cls":
            pooled = hidden[:, 0]
        elif self.pooling == "max":
            pooled = hidden.masked_fill(mask.unsqueeze(-1) == 0, float("-inf")).amax(dim=1)
        else:
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1e-9)
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu()

    def close(self) -> None:
        """Nothing to release but memory."""
