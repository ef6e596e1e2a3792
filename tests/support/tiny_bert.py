"""A tiny random BERT sentence-embedding model with a word-piece tokenizer, built offline in code, for tests of the
embeddings engine: transformers' BertModel and a real fast tokenizer, laid out as sentence-transformers lays out a
model directory (modules.json with mean pooling and Normalize, sentence_bert_config.json's max_seq_length)."""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ("the a of to and in is it cat dog fox river mountain quick brown lazy jumps over hello world paris "
         "france capital city weather sunny rain one two three").split()
MAX_TOKENS = 32


def save_tiny_bert(path: Path, max_tokens: int = MAX_TOKENS) -> Path:
    """Write the model to ``path`` (created); returns it."""
    import torch
    from transformers import BertConfig, BertModel, BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = SPECIAL + WORDS + list("abcdefghijklmnopqrstuvwxyz") + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizerFast(vocab={token: i for i, token in enumerate(vocab)}, do_lower_case=True).save_pretrained(path)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=64, pad_token_id=0)
    BertModel(config).eval().save_pretrained(path)
    (path / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (path / "1_Pooling").mkdir(exist_ok=True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 32,
                                                                 "pooling_mode_mean_tokens": True}))
    (path / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": max_tokens}))
    return path
