"""What an engine reports about itself after a step: how full it is (``EngineCapacity``, which the worker turns
into what it may pull) and its load and counters (``EngineStats``, for metrics). Snapshots taken on the step
thread (the only thread that touches the engine) and handed to the event loop as data; every engine fills them in
(ours from its scheduler: workers/engine/stats.py).
"""

from __future__ import annotations

import msgspec

from switchyard.workers.kv_tiers import KVTierStats

# Past this KV use the engine takes no new request whatever its seats: the ones it runs need the blocks to grow
# into, and a new one would only be preempted again.
KV_NEARLY_FULL = 0.95


class EngineCapacity(msgspec.Struct, frozen=True):
    """How full an engine is: what the worker's capacity (workers/service/capacity.py) turns into what it may
    pull from JetStream."""

    max_num_seqs: int  # seats: requests that may run at once
    num_free_seats: int  # requests that may be added now (0 while the KV cache is nearly full)
    num_running: int
    num_waiting: int  # queued inside the engine: not started yet, or preempted
    num_waiting_new: int  # of those, the ones never started (the preempted ones were pulled long ago)
    kv_cache_usage: float  # fraction of the KV cache in use, 0..1
    prefill_backlog_tokens: int = 0  # prompt tokens queued to compute (routing weighs a new request's wait by it)


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
    kv_tiers: list[KVTierStats] = msgspec.field(default_factory=list)  # the tiers below the pool, top first
    num_pauses: int = 0  # running sequences paused for a waiting tenant, their KV kept (scheduler/pausing.py)
    num_draft_tokens: int = 0  # speculative decoding: draft tokens computed, and those the model agreed with
    num_accepted_draft_tokens: int = 0
    num_steps_without_drafts: int = 0  # decode steps run without drafts: measured faster so for their batch's size
