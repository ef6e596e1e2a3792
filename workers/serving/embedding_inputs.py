"""A sentence-embedding model directory as both engines read it: whether it is one (``modules.json`` names a
pooling module), the longest input it takes, and its inputs as token ids (``EmbeddingInputs``: texts tokenized, a
client's token ids framed as the tokenizer frames a text). Ours runs it in workers/engine/embedding_model.py, the
vLLM engine through vLLM's pooling runner (workers/vllm_engine/embedder.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def read_json(path: Path) -> Any:
    """The JSON in ``path`` as parsed (a config object, or a list of modules), None when it cannot be read."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def is_sentence_embedding_model(path: str | Path) -> bool:
    """Whether ``path`` holds a sentence-transformers model (its ``modules.json`` names a pooling module): one that
    serves /v1/embeddings, whichever engine runs it."""
    modules = read_json(Path(path) / "modules.json")
    return isinstance(modules, list) and any(str(m.get("type", "")).endswith(".Pooling") for m in modules
                                             if isinstance(m, dict))


def max_input_tokens(path: str | Path) -> int | None:
    """The longest input the model in ``path`` takes: sentence-transformers' ``max_seq_length`` within the encoder's
    positions (None when neither is written down)."""
    path = Path(path)
    limits = [(read_json(path / "sentence_bert_config.json") or {}).get("max_seq_length"),
              (read_json(path / "config.json") or {}).get("max_position_embeddings")]
    sizes = [n for n in limits if isinstance(n, int) and n > 0]
    return min(sizes) if sizes else None


class EmbeddingInputs:
    """A sentence-embedding model's inputs as token ids: texts tokenized, a client's token ids framed as the
    tokenizer frames a text, and the longest input it takes (``max_tokens``)."""

    def __init__(self, tokenizer, max_tokens: int) -> None:
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        # How the tokenizer frames a text ([CLS] ... [SEP] for BERT), read off one it frames.
        bare = tokenizer("a", add_special_tokens=False)["input_ids"]
        framed = tokenizer("a", add_special_tokens=True)["input_ids"]
        start = next(i for i in range(len(framed)) if framed[i:i + len(bare)] == bare)
        self._prefix, self._suffix = framed[:start], framed[start + len(bare):]

    def with_special_tokens(self, ids: list[int]) -> list[int]:
        """Token ids given by a client, framed as the tokenizer frames a text ([CLS] ... [SEP] for BERT)."""
        return [*self._prefix, *ids, *self._suffix]

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.tokenizer(texts, add_special_tokens=True, truncation=False)["input_ids"]
