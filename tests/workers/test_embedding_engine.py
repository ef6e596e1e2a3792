"""The embeddings engine on a tiny random BERT (real transformers model, real tokenizer): batching across requests
gives each input its own vector, long requests span steps, deltas fit a message, tiers and the batch seat rule
order the inputs, aborts end requests, and what cannot run is refused before it is queued."""

from __future__ import annotations

import numpy as np
import pytest

from switchyard.shared.config import EngineSettings
from switchyard.shared.messages import EmbedInput, GenerateRequest, SamplingParams
from switchyard.workers.engine import embeddings
from switchyard.workers.engine.embedding_model import EmbeddingModel, plan_forwards
from switchyard.workers.engine.embeddings import EmbeddingEngine
from switchyard.workers.serving.interface import RequestRejected
from tests.support.tiny_bert import MAX_TOKENS, save_tiny_bert

TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "paris", "a cat and a dog in the river",
         "one two three", "sunny weather in the capital city of france"]


@pytest.fixture(scope="module")
def tiny_bert_dir(tmp_path_factory):
    return save_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def model(tiny_bert_dir) -> EmbeddingModel:
    return EmbeddingModel.load(tiny_bert_dir)


def request(request_id: str, texts=None, token_ids=None, tier: str = "pro", dimensions=None) -> GenerateRequest:
    return GenerateRequest(request_id, "bert", tier, SamplingParams(), 0.0, 0.0,
                           embed=EmbedInput(texts=texts, token_ids=token_ids, dimensions=dimensions))


def engine(model, max_num_seqs: int = 64) -> EmbeddingEngine:
    return EmbeddingEngine(model, EngineSettings(max_num_seqs=max_num_seqs), "bert")


def add(e: EmbeddingEngine, req: GenerateRequest) -> int:
    return e.add_request(req, e.prepare(req))


def run(e: EmbeddingEngine) -> dict[str, list]:
    """Step until idle: each request's deltas, in order."""
    out: dict[str, list] = {}
    while e.has_unfinished_requests():
        for delta in e.step():
            out.setdefault(delta.request_id, []).append(delta)
    return out


def vectors(deltas) -> np.ndarray:
    return np.stack([np.frombuffer(v, dtype="<f4") for d in deltas for v in d.embeddings or ()])


def alone(model: EmbeddingModel, text: str) -> np.ndarray:
    return model.encode(model.tokenize([text])).numpy()[0]


def test_vectors_match_sentence_transformers_on_the_same_inputs(model, tiny_bert_dir):
    """The reference implementation reads the same directory (modules.json, pooling, Normalize); inputs of mixed
    lengths share forwards here, padded, as they do not in a batch of one."""
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(tiny_bert_dir), device="cpu").encode(TEXTS, batch_size=len(TEXTS))
    e = engine(model)
    add(e, request("a", TEXTS))
    got = vectors(run(e)["a"])
    assert got.shape == reference.shape == (len(TEXTS), model.dimensions)
    cosines = (got * reference).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(reference, axis=1)
    assert cosines.min() >= 0.999


def test_inputs_of_several_requests_share_a_step_and_each_gets_its_own_vector(model):
    e = engine(model)
    add(e, request("a", TEXTS[:4]))
    add(e, request("b", TEXTS[4:]))
    out = run(e)
    assert e.num_steps_run == 1
    got = np.concatenate([vectors(out["a"]), vectors(out["b"])])
    want = np.stack([alone(model, t) for t in TEXTS])
    assert np.allclose(got, want, atol=1e-5)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)  # Normalize in modules.json
    for request_id, texts in (("a", TEXTS[:4]), ("b", TEXTS[4:])):
        last = out[request_id][-1]
        assert last.is_last and last.finish_reason == "stop"
        assert last.usage.prompt_tokens == sum(len(ids) for ids in model.tokenize(texts))


def test_a_request_larger_than_a_step_spans_steps_and_only_its_last_delta_ends_it(model, monkeypatch):
    monkeypatch.setattr(embeddings, "MAX_DELTA_BYTES", 3 * 32 * 4)  # three vectors a message
    e = engine(model, max_num_seqs=4)
    texts = [TEXTS[i % len(TEXTS)] for i in range(10)]
    add(e, request("big", texts))
    out = run(e)["big"]
    assert e.num_steps_run == 3  # 4 + 4 + 2 inputs
    assert [len(d.embeddings) for d in out] == [3, 1, 3, 1, 2]
    assert [d.is_last for d in out] == [False] * 4 + [True]
    assert np.allclose(vectors(out), np.stack([alone(model, t) for t in texts]), atol=1e-5)


def test_token_ids_are_framed_like_a_text(model):
    e = engine(model)
    ids = model.tokenizer("hello world", add_special_tokens=False)["input_ids"]
    add(e, request("ids", token_ids=[ids]))
    assert np.allclose(vectors(run(e)["ids"])[0], alone(model, "hello world"), atol=1e-6)


def test_dimensions_equal_to_the_models_are_honoured(model):
    e = engine(model)
    add(e, request("dims", ["hello world"], dimensions=model.dimensions))
    assert vectors(run(e)["dims"]).shape == (1, model.dimensions)


def test_higher_tiers_go_first_and_batch_inputs_keep_to_their_seats(model):
    e = engine(model, max_num_seqs=2)
    add(e, request("free", ["one", "two"], tier="free"))
    add(e, request("ent", ["three"], tier="enterprise"))
    first = e.step()
    assert [d.request_id for d in first] == ["ent", "free"] and not first[1].is_last
    e = engine(model, max_num_seqs=8)
    add(e, request("batch", TEXTS, tier="batch"))
    assert sum(len(d.embeddings or ()) for d in e.step(2)) == 2  # the worker's seat rule: two batch inputs


def test_aborted_requests_end_with_the_next_step(model):
    e = engine(model, max_num_seqs=1)
    add(e, request("x", TEXTS))
    e.step()
    assert e.abort_request("x") and not e.abort_request("nope")
    (final,) = e.step()
    assert final.finish_reason == "cancelled" and final.is_last and not e.has_unfinished_requests()


@pytest.mark.parametrize("req, param", [
    (GenerateRequest("chat", "bert", "pro", SamplingParams(), 0.0, 0.0, prompt="hi"), "model"),
    (request("dims", ["hi"], dimensions=8), "dimensions"),
    (request("long", ["cat " * MAX_TOKENS]), "input"),
    (request("vocab", token_ids=[[10_000]]), "input"),
])
def test_what_cannot_run_is_refused_before_it_is_queued(model, req, param):
    with pytest.raises(RequestRejected) as exc:
        engine(model).prepare(req)
    assert exc.value.error.param == param and exc.value.error.status == 400


def test_a_failed_step_fails_only_the_requests_it_ran(model, monkeypatch):
    e = engine(model, max_num_seqs=2)
    add(e, request("ran", ["one", "two", "three"]))  # its first two inputs run in the step that fails
    add(e, request("later", ["four"]))
    real = model.embed
    monkeypatch.setattr(model, "embed", lambda batch: (_ for _ in ()).throw(RuntimeError("boom")))
    (failed,) = e.step()
    assert (failed.request_id, failed.finish_reason, failed.is_last) == ("ran", "error", True)
    assert (failed.error.status, failed.error.code) == (500, "internal_error")
    monkeypatch.setattr(model, "embed", real)
    out = run(e)
    assert list(out) == ["later"] and out["later"][-1].is_last and vectors(out["later"]).shape == (1, 32)


def test_forwards_are_cut_where_padding_costs_more_than_another_forward():
    def padded(forwards, lengths):
        return sum(len(f) * max(lengths[i] for i in f) for f in forwards)

    same = [10] * 64
    assert plan_forwards(same, forward_cost=32) == [list(range(64))]  # nothing to save: one forward
    mixed = [60, 5, 6, 58, 7, 59]
    assert plan_forwards(mixed, forward_cost=32) == [[1, 2, 4], [3, 5, 0]]  # short ones unpadded by the long
    assert plan_forwards(mixed, forward_cost=10_000) == [[1, 2, 4, 3, 5, 0]]  # a forward dearer than any padding
    lengths = [(i * 37) % 61 + 4 for i in range(64)]
    forwards = plan_forwards(lengths, forward_cost=32, max_tokens=512)
    assert sorted(i for f in forwards for i in f) == list(range(64))
    assert all(len(f) * max(lengths[i] for i in f) <= 512 for f in forwards)
    # Never worse than the two plans at its ends: everything in one forward, or a forward each.
    cost = padded(forwards, lengths) + 32 * len(forwards)
    assert cost <= min(64 * max(lengths) + 32, sum(lengths) + 32 * 64)
    assert plan_forwards([300, 5000, 2], max_tokens=1024) == [[2], [0], [1]]  # longer than a forward: alone
