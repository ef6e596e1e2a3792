"""The engines a worker can serve from, by the name ``worker.engine`` gives (``--engine``, or a model's ``engine``
in the settings file): each entry builds a ``ServingEngine`` (workers/serving/interface.py) from the settings.

A new engine is a module implementing that interface and one entry here. An entry imports its engine only when
chosen, so an engine's own dependencies (its wheel, its environment) are needed only where it runs.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, get_args

from switchyard.shared.config import EngineName, SwitchyardConfig
from switchyard.workers.serving.interface import ServingEngine

log = logging.getLogger("switchyard.worker")

# The host tier of a prefill or decode worker that sets none (kv_offload_gib): the KV moves through it.
ROLE_HOST_TIER_GIB = 1.0


def _kernel_dtype(dtype: str, device: str, quantized: bool) -> str:
    """The dtype to load a model in: as set, but float32 for ``auto`` on a CPU when its weights or KV cache are
    quantized (the CPU kernels take float32 activations and scale back to float32, executor/linear.py)."""
    return "float32" if quantized and dtype == "auto" and device == "cpu" else dtype


def _switchyard(config: SwitchyardConfig) -> ServingEngine[Any]:
    """Ours: continuous batching over a paged KV cache, Llama-family models (workers/engine/engine.py)."""
    from switchyard.workers import model_store
    from switchyard.workers.engine.engine import Engine, EngineConfig

    t0 = time.monotonic()
    w = config.worker
    path = model_store.resolve(w.model, config.model_cache_dir)
    device = model_store.resolve_device(w.device)
    model, tokenizer = model_store.load(
        path, _kernel_dtype(w.dtype, device, bool(w.quantization or w.kv_cache_dtype == "int8")), device)
    log.info("loaded %s from %s in %.2f s", w.model, path, time.monotonic() - t0)
    draft = None  # speculative: draft's model (workers/engine/draft_model.py)
    if w.speculative_model is not None:
        draft_path = model_store.resolve(w.speculative_model, config.model_cache_dir)
        draft, draft_tokenizer = model_store.load(
            draft_path, _kernel_dtype(w.dtype, device, w.speculative_quantization is not None), device)
        if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
            raise ValueError(f"speculative_model {w.speculative_model!r} has another vocabulary than {w.model!r}: "
                             f"its drafts could not be checked token by token")
    # The worker publishes what its KV cache holds (workers/service/kv_events.py): the engine records it.
    engine_config = dataclasses.replace(EngineConfig.from_settings(config.worker), kv_events=True)
    if config.worker.role != "both" and engine_config.kv_offload_gib is None:
        # A prefill worker hands its prompts' blocks to the decode workers through the host tier: on, on a CPU too.
        engine_config = dataclasses.replace(engine_config, kv_offload_gib=ROLE_HOST_TIER_GIB)
    if config.worker.role == "prefill":  # and a block it drops is one the decode worker computes again
        engine_config = dataclasses.replace(engine_config, kv_offload_wait_when_behind=True)
    engine = Engine(model, tokenizer, engine_config, draft)
    engine.warmup()
    _load_safety_classifier(config)
    return engine


def _vllm(config: SwitchyardConfig) -> ServingEngine[Any]:
    """vLLM (V1, its engine core in this process), for what ours lacks: tensor parallelism, quantization,
    speculative decoding, KV offload, any architecture vLLM knows (workers/vllm_engine/). A sentence-embedding model
    (its ``modules.json`` names a pooling) runs on vLLM's pooling runner under the embeddings engine, serving
    /v1/embeddings. Needs vLLM installed where the worker runs (``make vllm-env``); refused with how to install it
    otherwise."""
    from switchyard.workers import model_store
    from switchyard.workers.serving.embedding_inputs import is_sentence_embedding_model
    from switchyard.workers.vllm_engine.environment import require_vllm

    require_vllm()
    _load_safety_classifier(config)
    path = model_store.resolve(config.worker.model, config.model_cache_dir)
    if is_sentence_embedding_model(path):
        from switchyard.workers.engine.embeddings import EmbeddingEngine
        from switchyard.workers.vllm_engine.embedder import VllmEmbedder

        return EmbeddingEngine(VllmEmbedder.from_settings(config.worker, str(path)), config.worker,
                               config.worker.served_name)
    from switchyard.workers.vllm_engine.engine import VllmEngine

    return VllmEngine.from_settings(config.worker, str(path))


def _load_safety_classifier(config: SwitchyardConfig) -> None:
    """The safety classifier, read now when the gateways' settings use it: read on first use, it would take a
    tenant's first request a second of CPU, holding the GIL (scikit-learn's import) while every other tenant's steps
    wait, and mark that tenant as one with expensive prompts (workers/service/intake.py). A worker without the wheel
    serves on; the requests that need it are refused, saying what to install."""
    if not config.gateway.safety.classifier:
        return
    from switchyard.shared.profanity import load_classifier

    t0 = time.monotonic()
    try:
        load_classifier()
    except RuntimeError as exc:
        log.warning("safety classifier not loaded: %s", exc)
        return
    log.info("safety classifier loaded in %.2f s", time.monotonic() - t0)


def _simulated(config: SwitchyardConfig) -> ServingEngine[Any]:
    """A test double that makes up tokens at a set rate, no model (workers/simulated_engine.py)."""
    from switchyard.workers.simulated_engine import SimulatedEngine

    w = config.worker
    log.warning("engine simulated: a TEST DOUBLE for load tests, %d seats at %g tokens/s each; no model runs",
                w.max_num_seqs, w.simulated_tokens_per_s)
    return SimulatedEngine(w.max_num_seqs, w.simulated_tokens_per_s, w.simulated_prefill_us_per_token,
                           w.simulated_output_tokens, w.simulated_tokens_per_delta, w.simulated_step_ms / 1000)


def _embeddings(config: SwitchyardConfig) -> ServingEngine[Any]:
    """A sentence-embedding model (BERT and kin) for /v1/embeddings (workers/engine/embeddings.py)."""
    from switchyard.workers import model_store
    from switchyard.workers.engine.embedding_model import EmbeddingModel
    from switchyard.workers.engine.embeddings import EmbeddingEngine

    t0 = time.monotonic()
    path = model_store.resolve(config.worker.model, config.model_cache_dir)
    model = EmbeddingModel.load(path, model_store.resolve_device(config.worker.device))
    log.info("loaded %s from %s in %.2f s", config.worker.model, path, time.monotonic() - t0)
    return EmbeddingEngine(model, config.worker, config.worker.served_name)


ENGINES: dict[str, Callable[[SwitchyardConfig], ServingEngine[Any]]] = {
    "switchyard": _switchyard,
    "simulated": _simulated,
    "vllm": _vllm,
    "embeddings": _embeddings,
}
TEST_DOUBLES = frozenset({"simulated"})  # engines whose output is made up: said so wherever the engine is named
WITHOUT_WEIGHTS = frozenset({"simulated"})  # engines that load no model (the launcher fetches none for them)


assert set(ENGINES) == set(get_args(EngineName)), "every engine the settings name has a builder, and no other"


def is_test_double(name: str) -> bool:
    return name in TEST_DOUBLES


def needs_weights(name: str) -> bool:
    return name not in WITHOUT_WEIGHTS


def engine_builder(name: str) -> Callable[[SwitchyardConfig], ServingEngine[Any]]:
    """The builder of the engine called ``name`` (the settings allow only the names in ``ENGINES``)."""
    return ENGINES[name]
