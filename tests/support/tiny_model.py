"""A tiny random Llama with a byte-level ChatML tokenizer, built offline in code, for tests.

It runs the real model code path (transformers' LlamaForCausalLM, a real fast tokenizer, a real chat template)
with random weights, so engine tests check token-level behaviour in milliseconds without downloading anything.

Token ids mirror SmolLM2 where it matters: 0 ``<|endoftext|>``, 1 ``<|im_start|>``, 2 ``<|im_end|>`` (EOS).
Ids 3..258 are the 256 bytes (GPT-2 byte-level alphabet), 259..511 a fixed set of merges, so the tokenizer covers
exactly the model's 512 logits and multi-byte UTF-8 characters always split across tokens.
"""

from __future__ import annotations

import os
from pathlib import Path

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
VOCAB_SIZE = 512
MAX_CONTEXT = 256

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def _merges() -> list[tuple[str, str]]:
    """253 merges: space + letter, frequent letter pairs, and a couple of trigrams (deterministic order)."""
    merges = [("Ġ", c) for c in "abcdefghijklmnopqrstuvwxyz"]  # 26
    frequent = "etaoinshrdlucm"  # 14 * 14 = 196
    merges += [(a, b) for a in frequent for b in frequent]
    extra_pairs = "fgpwybvk"  # a few more bigrams with the most frequent letters: 8 * 3 = 24
    merges += [(a, b) for a in extra_pairs for b in "eao"]
    merges += [("Ġt", "he"), ("in", "g"), ("Ġa", "nd"), ("Ġo", "f"), ("Ġi", "s"), ("Ġi", "n"), ("Ġt", "o")]
    return merges


def _byte_alphabet() -> list[str]:
    """The byte-level alphabet in byte order (id 3 + b for byte b): printable bytes stand for themselves, the rest
    map to the code points from 256 up, in order. ``ByteLevel.alphabet()`` has the same characters, but it comes
    from a hash set: its order, and with it every token id, would change from one process to the next."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def build_tokenizer():
    """A byte-level BPE ``PreTrainedTokenizerFast`` with ChatML specials, EOS ``<|im_end|>``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab: dict[str, int] = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    alphabet = _byte_alphabet()
    assert set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())
    for ch in alphabet:
        vocab[ch] = len(vocab)
    merges = _merges()
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    assert len(vocab) == VOCAB_SIZE, len(vocab)

    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
        unk_token="<|endoftext|>",
        pad_token="<|im_end|>",
        chat_template=CHATML_TEMPLATE,
        model_max_length=MAX_CONTEXT,
    )


def build_model(seed: int = 0, max_context: int = MAX_CONTEXT):
    """A 2-layer random ``LlamaForCausalLM`` (float32), the same weights for the same seed."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_context,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=False,
    )
    # Weight init draws from the global RNG: seed it, and restore it after so callers' randomness is untouched.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.eval()
    model.generation_config.eos_token_id = 2
    model.generation_config.pad_token_id = 2
    return model


def save_tiny_model(path: str | os.PathLike, seed: int = 0, max_context: int = MAX_CONTEXT) -> Path:
    """Build the tiny model and tokenizer and ``save_pretrained`` both into ``path``; returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    build_model(seed, max_context).save_pretrained(path)
    build_tokenizer().save_pretrained(path)
    return path
