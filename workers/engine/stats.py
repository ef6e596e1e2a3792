"""What the engine reports about itself after a step, for the worker's metrics: a snapshot taken on the step
thread (the only thread that touches the engine) and handed to the event loop as data."""

from __future__ import annotations

import msgspec


class EngineStats(msgspec.Struct):
    """The engine's load and its counters since start (vLLM's meanings)."""

    running: dict[str, int]  # tier -> sequences running (holding KV) now
    waiting: dict[str, int]  # tier -> sequences queued inside the engine (new or preempted)
    kv_cache_usage: float  # fraction of KV blocks in use, 0..1
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, found cached
    num_preemptions: int
    batch_size: int = 0  # sequences in the last step that ran
    num_batched_tokens: int = 0  # tokens computed in it (prefill chunks + decodes)
