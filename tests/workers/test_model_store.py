"""Model store: resolving specs and loading directories (offline), plus the real SmolLM2 pull (``model`` mark)."""

from __future__ import annotations

import pytest
import torch

from switchyard.workers.engine.engine import Engine
from switchyard.workers.model_store import MARKER, ModelNotFound, is_pulled, load, resolve


def test_resolve_accepts_an_existing_model_directory(tiny_model_dir, tmp_path):
    assert resolve(str(tiny_model_dir), tmp_path) == tiny_model_dir


def test_resolve_rejects_unknown_specs(tmp_path):
    with pytest.raises(ModelNotFound, match="neither a registry name"):
        resolve("no-such-model", tmp_path)
    with pytest.raises(ModelNotFound, match="neither a registry name"):
        resolve(str(tmp_path), tmp_path)  # a directory, but not a model


def test_a_half_written_model_is_not_pulled(tmp_path):
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    assert not is_pulled("smollm2", tmp_path)
    with pytest.raises(ModelNotFound, match="not pulled"):
        resolve("smollm2", tmp_path, pull_missing=False)
    (tmp_path / "smollm2" / MARKER).write_text("done\n")
    assert is_pulled("smollm2", tmp_path)
    assert resolve("smollm2", tmp_path, pull_missing=False) == tmp_path / "smollm2"


def test_load_dtypes(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir, dtype="bfloat16", device="cpu")
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    model, _ = load(tiny_model_dir, dtype="auto", device="cpu")
    assert model.dtype in (torch.bfloat16, torch.float32)
    with pytest.raises(ValueError, match="unknown dtype"):
        load(tiny_model_dir, dtype="float64")


@pytest.mark.model
def test_smollm2_pull_load_and_answer(smollm2_dir, make_request):
    assert is_pulled("smollm2", smollm2_dir.parent)
    assert resolve("smollm2", smollm2_dir.parent, pull_missing=False) == smollm2_dir

    # How long the load takes is bench/engine.py's to report ("Model load"), not a test's on a shared machine.
    model, tokenizer = load(smollm2_dir, dtype="bfloat16", device="cpu")

    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    assert model.config.max_position_embeddings == 8192
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                             tokenize=False)
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert rendered.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")

    engine = Engine(model, tokenizer)
    req = make_request(messages=[("user", "What is the capital of France?")], temperature=0, max_tokens=30)
    engine.add_request(req)
    text, final = "", None
    while engine.has_unfinished_requests():
        for delta in engine.step():
            text += delta.text
            final = delta
    assert "Paris" in text
    assert final.finish_reason == "stop"
    assert final.usage.completion_tokens < 30
