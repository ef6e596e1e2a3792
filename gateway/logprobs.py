"""The ``logprobs`` field of OpenAI responses, from the workers' per-token ``TokenLogprob`` entries.

Chat completions: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}],
"refusal": None}``. Legacy completions: ``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}],
"text_offset"}``, where ``text_offset`` counts characters from the start of the completion, across stream chunks.
"""

from __future__ import annotations

from switchyard.shared.messages import TokenLogprob


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob]) -> dict:
    return {
        "content": [{**_entry(e.token, e.logprob), "top_logprobs": [_entry(t, lp) for t, lp in e.top]}
                    for e in entries],
        "refusal": None,
    }


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> tuple[dict, int]:
    """The field for ``entries``, whose first token starts ``text_offset`` characters into the completion; and the
    offset just past the last one (where the next stream chunk's tokens start)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {
        "tokens": [e.token for e in entries],
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [dict(e.top) for e in entries],
        "text_offset": offsets,
    }, text_offset


class LogprobsFormatter:
    """Formats one choice's entries, chunk after chunk, for the request's endpoint; None when not requested."""

    def __init__(self, is_chat: bool, requested: bool, text_offset: int = 0):
        """``text_offset``: where the choice's next token starts (a stream taken over mid-way: what came before)."""
        self.is_chat = is_chat
        self.requested = requested
        self._text_offset = text_offset

    def format(self, entries: list[TokenLogprob] | None) -> dict | None:
        if not self.requested:
            return None
        if self.is_chat:
            return chat_logprobs(entries or [])
        out, self._text_offset = completion_logprobs(entries or [], self._text_offset)
        return out
