"""A token's text alone, as a logprob entry names it (both engines' logprobs)."""

from __future__ import annotations


class TokenTexts:
    """The text of each token id alone, decoded once and kept."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self._texts: dict[int, str] = {}  # token id -> its text alone

    def text(self, token_id: int) -> str:
        """The text of ``token_id`` alone, as a logprob entry names it."""
        text = self._texts.get(token_id)
        if text is None:
            # As the text is decoded (special tokens left out), so that the tokens spell the content.
            text = self._texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=True)
        return text
