"""Token ids in, text that is safe to send out: whole UTF-8 characters, and never any part of a stop string.

Two hold-backs, one after the other::

    token ids ──> [ window decode ] ──(whole characters)──> [ stop matcher ] ──> text to emit
                   prefix..read: decoded already, kept as context
                   read..end:    new ids; held while their text
                                 ends in U+FFFD (a split character)
                                                              held: the longest tail that could still
                                                              become a stop string

Only the window ``ids[prefix:]`` is ever decoded (the prefix/read offset technique of TGI and vLLM), and ids
before ``prefix`` are dropped, so each step costs O(window), not O(output). The context tokens matter for
tokenizers whose decode of a lone token differs from its decode in context (SentencePiece's leading spaces).
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT_CHAR = "\ufffd"
# Prompt tokens kept as decoding context for the first generated tokens (vLLM uses the same number).
_PROMPT_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """Feed generated token ids step by step; get back the text that may be emitted now.

    Once a stop string appears, ``is_stopped`` is true, the text before the stop is the last text returned, and
    further tokens are ignored. At the end of generation call ``flush()`` for whatever was held back.
    """

    def __init__(
        self,
        tokenizer,
        stop: Sequence[str] = (),
        prompt_token_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = [s for s in stop if s]  # an empty stop string would stop before the first character
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._held = ""  # whole characters that may be the start of a stop string
        self.is_stopped = False

    def add_token(self, token_id: int) -> str:
        return self.add_tokens((token_id,))

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Append generated ids; returns the newly emittable text (often ``""`` while something is held)."""
        if self.is_stopped:
            return ""
        self._ids.extend(token_ids)
        return self._match_stops(self._decode_new(final=False))

    def flush(self) -> str:
        """Generation ended: return everything still held (a trailing split character decodes as U+FFFD).

        Returns ``""`` after a stop string: what followed the stop is never emitted.
        """
        if self.is_stopped:
            return ""
        text = self._held + self._decode_new(final=True)
        self._held = ""
        return text

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or (full_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""  # nothing new yet, or the last character is still incomplete
        # Slide the window: the new ids become the next step's context, older ids are no longer needed.
        del self._ids[:self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        return full_text[len(prefix_text):]

    def _match_stops(self, text: str) -> str:
        if not self._stops or not text:
            return text
        held = self._held + text
        positions = [i for i in (held.find(s) for s in self._stops) if i >= 0]
        if positions:
            self.is_stopped = True
            self._held = ""
            return held[:min(positions)]
        keep = self._longest_stop_prefix_suffix(held)
        self._held = held[len(held) - keep:]
        return held[:len(held) - keep]

    def _longest_stop_prefix_suffix(self, text: str) -> int:
        """Length of the longest tail of ``text`` that some stop string starts with (a stop in progress)."""
        longest = min(len(text), max(len(s) for s in self._stops) - 1)
        for k in range(longest, 0, -1):
            tail = text[-k:]
            if any(s.startswith(tail) for s in self._stops):
                return k
        return 0
