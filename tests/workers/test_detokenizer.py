"""IncrementalDetokenizer with the tiny byte-level tokenizer, where every non-ASCII character spans tokens."""

from __future__ import annotations

import pytest

from switchyard.workers.serving.detokenizer import REPLACEMENT_CHAR, IncrementalDetokenizer
from tests.support.tiny_model import build_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def feed(tokenizer, text: str, **kwargs) -> tuple[list[str], IncrementalDetokenizer]:
    """Feed ``text`` one token at a time; returns the chunk emitted after each token."""
    detok = IncrementalDetokenizer(tokenizer, **kwargs)
    return [detok.add_token(t) for t in tokenizer.encode(text)], detok


MULTIBYTE = "héllo wörld — 日本語 😀👍🏽 ok"


def test_multibyte_characters_split_across_tokens_are_never_broken(tokenizer):
    ids = tokenizer.encode(MULTIBYTE)
    assert len(ids) > len(MULTIBYTE)  # really split: more tokens than characters
    assert any(REPLACEMENT_CHAR in tokenizer.decode([i]) for i in ids)
    chunks, detok = feed(tokenizer, MULTIBYTE)
    assert all(REPLACEMENT_CHAR not in c for c in chunks)
    assert "".join(chunks) + detok.flush() == MULTIBYTE
    assert "".join(chunks) == MULTIBYTE  # ends on a whole character: nothing left for flush


def test_flush_returns_an_incomplete_trailing_character(tokenizer):
    ids = tokenizer.encode("ab😀")
    detok = IncrementalDetokenizer(tokenizer)
    assert "".join(detok.add_token(t) for t in ids[:-1]) == "ab"  # three of the emoji's four bytes: held
    assert detok.flush() == REPLACEMENT_CHAR


def test_special_tokens_are_skipped(tokenizer):
    chunks, detok = feed(tokenizer, "hi<|im_end|><|endoftext|> there")
    assert "".join(chunks) + detok.flush() == "hi there"


def test_prompt_context_is_not_repeated(tokenizer):
    prompt = tokenizer.encode("<|im_start|>user\nsay hi<|im_end|>\n<|im_start|>assistant\n")
    detok = IncrementalDetokenizer(tokenizer, prompt_token_ids=prompt)
    out = "".join(detok.add_token(t) for t in tokenizer.encode("Hi! ¿Qué tal?"))
    assert out + detok.flush() == "Hi! ¿Qué tal?"


def test_stop_string_spanning_tokens_is_not_emitted(tokenizer):
    text = "Hello world STOP and more"
    chunks, detok = feed(tokenizer, text, stop=["STOP"])
    assert "".join(chunks) == "Hello world "
    assert detok.is_stopped
    assert detok.add_token(tokenizer.encode("x")[0]) == ""
    assert detok.flush() == ""


def test_possible_stop_prefix_is_held_until_resolved(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["abc"])
    emitted = ""
    for ch in "xxab":
        emitted += detok.add_tokens(tokenizer.encode(ch))
    assert emitted == "xx"  # "ab" could be the start of "abc"
    emitted += detok.add_tokens(tokenizer.encode("x"))
    assert emitted == "xxabx"  # it was not
    emitted += detok.add_tokens(tokenizer.encode("ab"))
    assert emitted == "xxabx"
    assert detok.flush() == "ab"  # finished without a stop: held text is released
    assert not detok.is_stopped


def test_earliest_of_several_stops_wins_and_multibyte_stops_work(tokenizer):
    chunks, detok = feed(tokenizer, "one, two. café! three", stop=["three", "é!", "two"])
    assert "".join(chunks) == "one, "
    chunks, detok = feed(tokenizer, "one café! three", stop=["three", "é!"])
    assert "".join(chunks) == "one caf"
    assert detok.is_stopped


def test_stop_at_the_very_start_and_empty_stops_ignored(tokenizer):
    chunks, detok = feed(tokenizer, "STOP here", stop=["", "STOP"])
    assert "".join(chunks) == "" and detok.is_stopped
    chunks, detok = feed(tokenizer, "abc", stop=[""])
    assert "".join(chunks) == "abc" and not detok.is_stopped


def test_several_tokens_at_once(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, stop=["END"])
    ids = tokenizer.encode("naïve résumé END tail")
    out = detok.add_tokens(ids[:7]) + detok.add_tokens(ids[7:])
    assert out == "naïve résumé " and detok.is_stopped


def test_window_stays_small_on_long_outputs(tokenizer):
    # The sliding window drops decoded ids: each step decodes a handful of tokens, not the whole output.
    text = "the quick brown fox jumps over the lazy dog. " * 40
    detok = IncrementalDetokenizer(tokenizer, stop=["never appears"])
    out = []
    for t in tokenizer.encode(text):
        out.append(detok.add_token(t))
        assert len(detok._ids) <= 4
    assert "".join(out) + detok.flush() == text
