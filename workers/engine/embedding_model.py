"""A sentence-embedding model on the device: a Hugging Face encoder (BERT and kin) and the pooling its
sentence-transformers configuration names, so its vectors are the reference implementation's.

    token ids (ragged) ─▶ padded batch + attention mask ─▶ encoder ─▶ pooling (mean | cls | max) ─▶ L2 normalize?

Read from the model directory: ``modules.json`` (a ``Normalize`` module means unit vectors), ``1_Pooling/config.json``
(the pooling mode) and ``sentence_bert_config.json`` (``max_seq_length``: the longest input the model was trained
for; a longer one is refused, where the reference would cut it silently). Without them: mean pooling, normalized,
and the encoder's position limit.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import torch

log = logging.getLogger("switchyard.worker")


def _read_json(path: Path) -> dict | list | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class EmbeddingModel:
    """Encodes batches of token id lists into vectors; touched from the step thread only."""

    def __init__(self, encoder, tokenizer, pooling: str = "mean", normalize: bool = True,
                 max_tokens: int = 512) -> None:
        self.encoder = encoder
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.normalize = normalize
        self.max_tokens = max_tokens
        self.dimensions = encoder.config.hidden_size
        self.device = next(encoder.parameters()).device
        self.pad_id = tokenizer.pad_token_id or 0
        # How the tokenizer frames a text ([CLS] ... [SEP] for BERT), read off one it frames.
        bare = tokenizer("a", add_special_tokens=False)["input_ids"]
        framed = tokenizer("a", add_special_tokens=True)["input_ids"]
        start = next(i for i in range(len(framed)) if framed[i:i + len(bare)] == bare)
        self._prefix, self._suffix = framed[:start], framed[start + len(bare):]

    @classmethod
    def load(cls, path: str | Path, device: str = "cpu") -> "EmbeddingModel":
        """The model in ``path`` (never the network), in float32: the vectors must match the reference's."""
        from transformers import AutoModel, AutoTokenizer

        path = Path(path)
        encoder = AutoModel.from_pretrained(path, local_files_only=True, dtype=torch.float32).to(device).eval()
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        modules = _read_json(path / "modules.json") or []
        pooling_dir = next((m["path"] for m in modules if m.get("type", "").endswith(".Pooling")), "1_Pooling")
        pooling_cfg = _read_json(path / pooling_dir / "config.json") or {}
        pooling = ("cls" if pooling_cfg.get("pooling_mode_cls_token") else
                   "max" if pooling_cfg.get("pooling_mode_max_tokens") else "mean")
        normalize = not modules or any(m.get("type", "").endswith(".Normalize") for m in modules)
        limit = (_read_json(path / "sentence_bert_config.json") or {}).get("max_seq_length")
        max_tokens = min(limit or 10**9, encoder.config.max_position_embeddings)
        log.info("embedding model %s: %d dimensions, %s pooling%s, inputs up to %d tokens", path.name,
                 encoder.config.hidden_size, pooling, ", normalized" if normalize else "", max_tokens)
        return cls(encoder, tokenizer, pooling, normalize, max_tokens)

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """Token ids given by a client, framed as the tokenizer frames a text ([CLS] ... [SEP] for BERT)."""
        return [*self._prefix, *ids, *self._suffix]

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]

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
