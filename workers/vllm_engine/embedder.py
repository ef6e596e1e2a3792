"""A sentence-embedding model run by vLLM's pooling runner: the embedder (``Embedder``, workers/engine/embeddings.py)
of an embeddings engine on ``--engine vllm``.

    EmbeddingEngine.step ─▶ embed(the step's inputs, as token ids)
                              └─▶ LLMEngine.add_request(id, {"prompt_token_ids": ...}, PoolingParams("embed")) each
                                  LLMEngine.step() until every one is finished (vLLM batches them by its own token
                                  budget, unpadded) ─▶ PoolingRequestOutput.outputs.data ─▶ float32 [n, dimensions]

The queue, tiers, deltas and usage stay the embeddings engine's, so the wire is the same as with our model. The
pooling is what the model directory's sentence-transformers files say (vLLM reads ``modules.json``,
``1_Pooling/config.json`` and ``sentence_bert_config.json`` as sentence-transformers does: all-MiniLM-L6-v2 is mean
pooling, normalized, 256 tokens), and so is the tokenizer (``EmbeddingInputs``, shared with our model).

vLLM is imported only when an embedder is built.
"""

from __future__ import annotations

import itertools
import logging
import os
import time

import numpy as np

from switchyard.shared.config import WorkerConfig
from switchyard.workers.serving.embedding_inputs import EmbeddingInputs, max_input_tokens
from switchyard.workers.vllm_engine import args as vllm_args

log = logging.getLogger("switchyard.engine")


class VllmEmbedder(EmbeddingInputs):
    """vLLM's ``LLMEngine`` with the pooling runner, one step of the embeddings engine at a time (step thread)."""

    def __init__(self, llm, tokenizer) -> None:
        from vllm.platforms import current_platform
        from vllm.pooling_params import PoolingParams

        super().__init__(tokenizer, int(llm.vllm_config.model_config.max_model_len))
        self._llm = llm
        self._params = PoolingParams(task="embed")
        self._ids = itertools.count()
        self._device_type = "cpu" if current_platform.is_cpu() else "cuda"
        # The pooler's output size (a Dense module may change the encoder's), read off one input: it warms up too.
        self.dimensions = int(self.embed([self.tokenize(["warm up"])[0]]).shape[1])

    @classmethod
    def from_settings(cls, worker: WorkerConfig, model_path: str) -> VllmEmbedder:
        """vLLM's ``LLMEngine`` for the embedding model at ``model_path`` (workers/vllm_engine/args.py)."""
        os.environ.update(vllm_args.process_env(worker))
        import torch
        from transformers import AutoTokenizer
        from vllm import EngineArgs, LLMEngine

        on_gpu = torch.cuda.is_available()
        limit = worker.vllm.max_model_len or max_input_tokens(model_path)
        kwargs = vllm_args.pooling_kwargs(worker, model_path, on_gpu, limit)
        log.info("vLLM embedding engine: %s", ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
        t0 = time.monotonic()
        llm = LLMEngine.from_engine_args(EngineArgs(**kwargs))
        if "embed" not in llm.get_supported_tasks():
            llm.engine_core.shutdown()
            raise ValueError(f"vLLM cannot embed with {model_path}: its tasks are {llm.get_supported_tasks()}")
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        embedder = cls(llm, tokenizer)
        log.info("vLLM embedding engine ready in %.1f s: %d dimensions, inputs up to %d tokens",
                 time.monotonic() - t0, embedder.dimensions, embedder.max_tokens)
        return embedder

    @property
    def device_type(self) -> str:
        return self._device_type

    def embed(self, batch: list[list[int]]) -> np.ndarray:
        """``batch``'s vectors, float32 [len(batch), dimensions] in its order: every input a vLLM request, stepped
        until all are done. Raises what vLLM raises (the embeddings engine fails the step's requests), with
        whatever is left aborted."""
        ids = [f"e{next(self._ids)}" for _ in batch]
        wanted = set(ids)
        rows: dict[str, np.ndarray] = {}
        added: list[str] = []
        try:
            for request_id, tokens in zip(ids, batch):
                self._llm.add_request(request_id, {"prompt_token_ids": tokens}, self._params)
                added.append(request_id)
            while len(rows) < len(ids):
                for out in self._llm.step():
                    if out.finished and out.request_id in wanted:
                        rows[out.request_id] = out.outputs.data.float().cpu().numpy()
                if len(rows) < len(ids) and not self._llm.has_unfinished_requests():
                    raise RuntimeError(f"vLLM finished {len(rows)} of {len(ids)} embeddings")
        except BaseException:
            left = [i for i in added if i not in rows]
            if left:
                self._llm.abort_request(left)
            raise
        return np.stack([rows[i] for i in ids]).astype(np.float32, copy=False)

    def close(self) -> None:
        """Stop vLLM's engine core."""
        self._llm.engine_core.shutdown()
