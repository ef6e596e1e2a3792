"""The embeddings engine over vLLM's pooling runner (``--engine vllm`` on an embedding model), built as a worker
builds it and driven through ``harness.EngineProcess``: all-MiniLM-L6-v2's vectors match sentence-transformers',
inputs of several requests share a step and a request larger than a step spans several, token ids embed like their
text, usage counts the tokens run, and what cannot run is refused before it is queued, as on our embedder."""

from __future__ import annotations

import shutil
import uuid

import numpy as np
import pytest

from switchyard.shared.messages import EmbedInput, ErrorInfo, GenerateRequest, SamplingParams
from switchyard.workers.model_store import pull
from tests.vllm_engine.conftest import start_engine
from tests.workers.conftest import model_cache_dir

pytestmark = pytest.mark.model
TEXTS = ["The capital of France is Paris.", "hi", "A quick brown fox jumps over the lazy dog.",
         "Embeddings map text to vectors, so that similar texts land close together. " * 4,
         "one two three", "sunny weather in the capital city"]


@pytest.fixture(scope="module")
def minilm():
    return pull("all-minilm-l6-v2", model_cache_dir())


@pytest.fixture(scope="module")
def engine(vllm_env_python, minilm):
    """Four inputs a step (so six take two)."""
    engine, work = start_engine(vllm_env_python, minilm, max_num_seqs=4)
    try:
        yield engine
    finally:
        engine.close()
        shutil.rmtree(work, ignore_errors=True)


@pytest.fixture(scope="module")
def reference(minilm):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm), device="cpu")


def embed_request(texts=None, token_ids=None, dimensions=None, request_id=None) -> GenerateRequest:
    return GenerateRequest(request_id or f"e-{uuid.uuid4().hex[:8]}", "minilm", "pro", SamplingParams(), 0.0, 0.0,
                           embed=EmbedInput(texts=texts, token_ids=token_ids, dimensions=dimensions))


def vectors(deltas) -> np.ndarray:
    return np.stack([np.frombuffer(v, dtype="<f4") for d in deltas for v in d.embeddings or ()])


def by_request(steps) -> dict[str, list]:
    out: dict[str, list] = {}
    for step in steps:
        for delta in step:
            out.setdefault(delta.request_id, []).append(delta)
    return out


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_it_is_the_embeddings_engine_at_the_models_length(engine):
    # sentence_bert_config's max_seq_length
    assert (engine.info["max_context"], engine.info["device_type"]) == (256, "cpu")


def test_vectors_match_sentence_transformers_across_steps_in_order(engine, reference, minilm):
    a, b = embed_request(TEXTS[:4]), embed_request(TEXTS[4:])
    tokens = reference.tokenizer(TEXTS, add_special_tokens=True)["input_ids"]
    assert engine.add(a) == sum(len(t) for t in tokens[:4])
    assert engine.add(b) == sum(len(t) for t in tokens[4:])
    steps = engine.run()
    assert len(steps) == 2  # four inputs a step: a's four, then b's two
    out = by_request(steps)
    got = np.concatenate([vectors(out[a.request_id]), vectors(out[b.request_id])])
    assert got.shape == (6, 384)
    assert cosines(got, reference.encode(TEXTS)).min() >= 0.999
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # Normalize, as modules.json says
    for request, texts in ((a, TEXTS[:4]), (b, TEXTS[4:])):
        last = out[request.request_id][-1]
        assert last.is_last and last.finish_reason == "stop"
        assert last.usage.prompt_tokens == sum(len(t) for t in reference.tokenizer(texts)["input_ids"])
        assert last.usage.completion_tokens == 0


def test_token_ids_embed_like_their_text(engine, reference):
    ids = reference.tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    request = embed_request(token_ids=[ids])
    engine.add(request)
    (delta,) = by_request(engine.run())[request.request_id]
    assert cosines(vectors([delta]), reference.encode(TEXTS[:1]))[0] >= 0.9999


@pytest.mark.parametrize("request_, param", [
    (embed_request(["hi"], dimensions=128), "dimensions"),
    (embed_request(["word " * 300]), "input"),
    (embed_request(token_ids=[[30522]]), "input"),
    (GenerateRequest("chat", "minilm", "pro", SamplingParams(), 0.0, 0.0, prompt="hi"), "model"),
])
def test_what_cannot_run_is_refused_before_it_is_queued(engine, request_, param):
    refused = engine.add(request_)
    assert isinstance(refused, ErrorInfo) and (refused.param, refused.status) == (param, 400)
    assert engine.capacity()["num_waiting"] == 0
