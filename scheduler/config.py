"""The scheduler's settings: batch and cache limits, checked when made so that a bad one fails at start."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerConfig:
    """Batch and cache limits; validated on construction so a bad config fails at startup."""

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0  # 0 = off; else the most tokens one sequence gets per step
    # A step that prefills a request leaves out decodes of strictly less important ones: on hardware where a
    # step's cost grows with its batch (CPUs), that keeps a pro request's first token from waiting on a full
    # batch of batch-tier decodes. Those decodes lose one step; nothing else changes for them.
    isolate_priority_prefill: bool = True
    # Sequences of this priority or less important are background work (batch jobs): they can be limited to a few
    # per step (set_background_limit) and a step of nothing else may be abandoned. None: no background work.
    background_priority: int | None = None
    # Keep a list of the blocks registered in the prefix cache (KVCacheManager.take_newly_cached), for an engine
    # that writes them to a tier below the pool.
    record_cached_blocks: bool = False
    # Keep the pool's net changes (registered, evicted hashes) for an engine that publishes KV events.
    record_kv_events: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "num_blocks", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("SchedulerConfig.long_prefill_token_threshold must be >= 0 (0 = off)")
        # One sequence of max_model_len tokens must fit alone once all others are preempted, or it never runs.
        if self.num_blocks * self.block_size < self.max_model_len:
            need = -(-self.max_model_len // self.block_size)
            raise ValueError(
                f"KV cache holds {self.num_blocks * self.block_size} tokens, less than max_model_len="
                f"{self.max_model_len}: set num_blocks >= {need} or lower max_model_len"
            )
