"""A stand-in tokenizer for random-weight models that come without one (the engine needs encode and decode)."""

from __future__ import annotations


class IdTokenizer:
    """A prompt is its token ids written out ("12 7 301"); decoded text is the ids, each after a space."""

    eos_token_id = None
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        return [int(t) for t in text.split()]

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f" {i}" for i in ids)
