"""Prompt assembly bounds: a conversation's history fitted to the context drops exactly the oldest turns that do
not fit, with a handful of template renders however long the history (it was one render per message dropped)."""

from __future__ import annotations

import msgspec

from switchyard.workers.serving import prompts
from switchyard.workers.serving.prompts import _encode_chat, fit_history


def test_fit_history_drops_the_fewest_oldest_turns_in_a_few_renders(tiny, make_request, monkeypatch):
    _, tokenizer = tiny
    turns = [("system", "be brief")] + [("user" if i % 2 == 0 else "assistant", f"turn number {i}")
                                        for i in range(400)]
    req = make_request(messages=turns, max_tokens=8)
    req = msgspec.structs.replace(req, truncate_history=True)
    renders = 0
    real = prompts._encode_chat

    def counting(*args, **kwargs):
        nonlocal renders
        renders += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(prompts, "_encode_chat", counting)
    max_context = 256
    ids, dropped = fit_history(tokenizer, req, max_context)
    assert 0 < dropped < 400 and len(ids) <= max_context - 8
    assert renders <= 12, renders  # log2(400) + 2, not 400
    # The fewest: keeping one more of the dropped turns would not fit.
    kept = [{"role": "system", "content": "be brief"}] + [{"role": r, "content": c} for r, c in turns[dropped:]]
    assert len(_encode_chat(tokenizer, kept, None)) > max_context - 8
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nbe brief")
