"""The worker's settings as vLLM's ``EngineArgs``: what the vLLM engine is built from.

    WorkerConfig ─┬─ shared with our engine: max_num_seqs, max_num_batched_tokens, kv_cache_gib,
                  │  enable_prefix_caching, dtype, cuda_graphs            ─┐
                  └─ vllm (VllmSettings): tensor/pipeline parallel sizes,  ├─▶ engine_kwargs() ─▶ EngineArgs(**kwargs)
                     quantization, kv_cache_dtype, speculative_config,     │
                     KV offloading, max_model_len, GPU memory, eager,      │
                     the KV connector of a prefill or decode worker       ─┘
                     (kv_transfer.py), engine_args (anything else, as given: it wins)
                  + what the platform needs: priority scheduling (tiers), logprobs up to 20, llguidance grammars,
                    and KV events on an endpoint of the worker's own (kv_events.py turns them into ours)

Pure (no vLLM import), so the mapping is tested where vLLM is not installed.
"""

from __future__ import annotations

from switchyard.shared.config import PROMPT_LOOKUP_MAX, PROMPT_LOOKUP_MIN, WorkerConfig
from switchyard.workers.vllm_engine import kv_transfer

# OpenAI's most top_logprobs (chat); vLLM refuses more than max_logprobs.
MAX_LOGPROBS = 20
CPU_KV_CACHE_GIB = 2  # ours' default on a CPU too: both engines get the same KV budget unless told otherwise


def engine_kwargs(worker: WorkerConfig, model_path: str, on_gpu: bool, native_bf16: bool = False,
                  kv_events_endpoint: str | None = None) -> dict:
    """``EngineArgs`` keyword arguments for serving ``model_path`` with ``worker``'s settings. ``on_gpu``: a CUDA
    device is there; ``native_bf16``: this CPU does bf16 in hardware (else ``dtype: auto`` takes float32 on a CPU:
    vLLM-CPU in emulated bf16 is several times slower than in float32); ``kv_events_endpoint``: where vLLM
    publishes its KV events (a ZMQ endpoint it binds), for the worker's (``kv_events_subscription``); none without
    prefix caching, which is what hashes blocks."""
    v = worker.vllm
    if worker.quantization is not None:
        raise ValueError("quantization: our engine's int8, w8a8 or int4; a vLLM worker's is vllm.quantization (one of "
                         "the methods vLLM names, e.g. fp8)")
    if worker.speculative == "draft":
        raise ValueError("speculative: draft is our engine's draft model; a vLLM worker's is vllm.speculative_config "
                         "(e.g. {\"model\": \"path/to/draft\", \"num_speculative_tokens\": 3})")
    if worker.kv_cache_dtype != "auto":
        raise ValueError("kv_cache_dtype: our engine's int8 KV cache; a vLLM worker's is vllm.kv_cache_dtype (e.g. "
                         "fp8)")
    if worker.tune_threads:
        raise ValueError("tune_threads: our engine's CPU step threads; vLLM-CPU binds its own threads "
                         "(VLLM_CPU_OMP_THREADS_BIND)")
    if worker.kv_offload_dir is not None:
        raise ValueError("kv_offload_dir: the disk KV tier is our engine's; a vLLM worker offloads to host memory only "
                         "(kv_offload_gib, vLLM's kv_offloading_size)")
    dtype = worker.dtype
    if dtype == "auto" and not on_gpu:
        dtype = "bfloat16" if native_bf16 else "float32"
    enforce_eager = v.enforce_eager
    if enforce_eager is None:
        # A CPU: no torch.compile (minutes at a first start); a GPU: CUDA graphs unless the worker turned them off.
        enforce_eager = not worker.cuda_graphs if on_gpu else True
    kv_gib = worker.kv_cache_gib if worker.kv_cache_gib is not None else (None if on_gpu else CPU_KV_CACHE_GIB)
    kwargs = dict(
        model=model_path,
        served_model_name=worker.served_name,
        dtype=dtype,
        tensor_parallel_size=v.tensor_parallel_size,
        pipeline_parallel_size=v.pipeline_parallel_size,
        quantization=v.quantization,
        kv_cache_dtype=v.kv_cache_dtype,
        speculative_config=v.speculative_config or _speculative_config(worker),
        # The worker's host KV tier is vLLM's own offloading here (host memory, on a GPU).
        kv_offloading_size=v.kv_offloading_size if v.kv_offloading_size is not None else worker.kv_offload_gib or None,
        kv_offloading_backend=v.kv_offloading_backend,
        max_model_len=v.max_model_len,
        gpu_memory_utilization=v.gpu_memory_utilization,
        kv_cache_memory_bytes=None if kv_gib is None else int(kv_gib * 2**30),
        enforce_eager=enforce_eager,
        max_num_seqs=worker.max_num_seqs,
        # Ours is a per-step budget of at least one token per sequence; vLLM wants at least max_num_seqs too.
        max_num_batched_tokens=max(worker.max_num_batched_tokens, worker.max_num_seqs),
        enable_prefix_caching=worker.enable_prefix_caching,
        # The platform's own needs: a tier is a priority (lower first, preempted last), logprobs as OpenAI allows
        # them, and grammars written in llguidance's Lark (the same text our engine compiles).
        scheduling_policy="priority",
        max_logprobs=MAX_LOGPROBS,
        structured_outputs_config={"backend": "guidance"},
        # Disaggregated serving: the worker's role as vLLM's KV connector (kv_transfer.py).
        kv_transfer_config=kv_transfer.connector_config(worker),
        kv_events_config=None if kv_events_endpoint is None or not worker.enable_prefix_caching else {
            "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": kv_events_endpoint, "topic": ""},
        # Weights and tokenizer come from the local directory: model hubs are never asked.
        tokenizer=model_path,
        trust_remote_code=False,
    )
    kwargs.update(v.engine_args)
    kwargs = {k: val for k, val in kwargs.items() if val is not None}
    kv_transfer.check_offloading(kwargs)
    return kwargs


def _speculative_config(worker: WorkerConfig) -> dict | None:
    """The worker's ``speculative`` setting as vLLM's n-gram method, with our n-gram sizes."""
    if worker.speculative != "ngram":
        return None
    return {"method": "ngram", "num_speculative_tokens": worker.num_speculative_tokens,
            "prompt_lookup_min": PROMPT_LOOKUP_MIN, "prompt_lookup_max": PROMPT_LOOKUP_MAX}


def kv_events_subscription(kwargs: dict) -> tuple[str, str] | None:
    """The ZMQ endpoint and topic to subscribe to vLLM's KV events at, as ``kwargs`` (``engine_kwargs``, with what
    ``engine_args`` changed) configure them; None when they are off or cannot be reached from here (a ``tcp://*:0``
    port is vLLM's to choose). A tcp endpoint vLLM binds on every interface is reached on loopback."""
    config = kwargs.get("kv_events_config")
    if not isinstance(config, dict) or not config.get("enable_kv_cache_events") \
            or config.get("publisher", "zmq") != "zmq":
        return None
    endpoint = str(config.get("endpoint", "tcp://*:5557"))  # vLLM's default
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
        if port == "0":
            return None
        if host in ("*", "0.0.0.0", "[::]", "::"):
            endpoint = f"tcp://127.0.0.1:{port}"
    return endpoint, str(config.get("topic", ""))


def pooling_kwargs(worker: WorkerConfig, model_path: str, on_gpu: bool, max_input_tokens: int | None) -> dict:
    """``EngineArgs`` keyword arguments for embedding with ``model_path`` through vLLM's pooling runner: the
    generation engine's (``engine_kwargs``) but for what pooling changes. On a CPU ``dtype: auto`` is float32, as our
    embedder runs (the vectors must match the reference's); no prefix caching (an encoder attends both ways: no
    prefix of one input is another's); vLLM's step budget is ``max_num_batched_tokens`` raised to the model's
    longest input (``max_input_tokens``) where that is longer: vLLM never splits a pooled input across steps, and
    refuses to start with a budget that cannot hold one. (The budget hardly matters unpadded: all-MiniLM-L6-v2 at
    batch 64 ran at 199-205 inputs/s with 512 to 4,096 tokens on a 2-core EPYC.)"""
    kwargs = engine_kwargs(worker, model_path, on_gpu, native_bf16=False)
    # Generation's alone (an embedding worker serves whole requests: no KV connector).
    for name in ("scheduling_policy", "max_logprobs", "structured_outputs_config", "kv_transfer_config"):
        kwargs.pop(name, None)
    kwargs.update(runner="pooling", enable_prefix_caching=False,
                  max_num_batched_tokens=max(kwargs["max_num_batched_tokens"], max_input_tokens or 0))
    kwargs.update(worker.vllm.engine_args)
    return kwargs


def process_env(worker: WorkerConfig) -> dict[str, str]:
    """Environment variables vLLM must see before it builds an engine: where its engine core runs (see
    ``VllmSettings.engine_core_process``), and no usage report to a server outside."""
    return {"VLLM_ENABLE_V1_MULTIPROCESSING": "1" if worker.vllm.engine_core_process else "0",
            "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
