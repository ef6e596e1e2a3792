"""Driving an engine directly over chat prompts, and a model's perplexity on a text: what the checks of a real model
(tests/workers/test_smollm2_fast_paths.py) and the engine benchmarks (bench/quantization.py, bench/speculation.py)
share."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch

from switchyard.shared.messages import ChatMessage, GenerateRequest, SamplingParams
from switchyard.workers.engine.engine import Engine
from switchyard.workers.executor.model_runner import ModelRunner, SeqChunk


@dataclass(slots=True)
class Run:
    """Prompts run to their ends together: wall seconds, tokens generated, and each prompt's output."""

    seconds: float
    num_tokens: int
    token_ids: list[list[int]]
    texts: list[str]


def chat_request(request_id: str, prompt: str, max_tokens: int, **sampling) -> GenerateRequest:
    """A one-message chat request, greedy unless ``sampling`` says otherwise."""
    return GenerateRequest(request_id, "model", "pro", SamplingParams(**{"temperature": 0, **sampling,
                                                                         "max_tokens": max_tokens}),
                           0.0, 0.0, messages=[ChatMessage("user", prompt)])


def run_prompts(engine: Engine, prompts: list[str], max_tokens: int, first_id: int = 0, **sampling) -> Run:
    """``prompts`` added at once and stepped to their ends (request ids from ``first_id``: an engine keeps none
    after a request ends, so later runs may start anywhere past the ones still running); greedy unless
    ``sampling`` says otherwise."""
    ids = [f"r{first_id + i}" for i in range(len(prompts))]
    token_ids: dict[str, list[int]] = {request_id: [] for request_id in ids}
    texts = dict.fromkeys(ids, "")
    num_tokens = 0
    started = time.perf_counter()
    for request_id, prompt in zip(ids, prompts):
        engine.add_request(chat_request(request_id, prompt, max_tokens, **sampling))
    while engine.has_unfinished_requests():
        for delta in engine.step():
            token_ids[delta.request_id] += delta.token_ids or []
            texts[delta.request_id] += delta.text
            num_tokens += delta.num_tokens
    return Run(time.perf_counter() - started, num_tokens, [token_ids[i] for i in ids], [texts[i] for i in ids])


def perplexity(model, tokenizer, text: str, quantization: str | None = None, kv_cache_dtype: str = "auto") -> float:
    """exp of the model's mean next-token loss over ``text``: one forward of the whole text through our runner (its
    weights as ``quantization`` says, its KV cache as ``kv_cache_dtype``), every row's logits."""
    ids = tokenizer.encode(text)
    blocks = -(-len(ids) // 16)
    runner = ModelRunner(model, blocks, 16, quantization=quantization, kv_cache_dtype=kv_cache_dtype)
    logits = runner.execute([SeqChunk(ids, 0, list(range(blocks)), True, len(ids) - 1)])
    return math.exp(torch.nn.functional.cross_entropy(logits[:-1].float(), torch.tensor(ids[1:])).item())
