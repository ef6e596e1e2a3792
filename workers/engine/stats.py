"""Our engine's capacity and stats (workers/serving/stats.py's types) read off its scheduler."""

from __future__ import annotations

from switchyard.scheduler import Scheduler
from switchyard.shared.tiers import TIER_NAMES, get_tier
from switchyard.workers.kv_tiers import KVTierStats
from switchyard.workers.serving.stats import KV_NEARLY_FULL, EngineCapacity, EngineStats

_TIER_BY_PRIORITY = {get_tier(name).priority: name for name in TIER_NAMES}


def capacity_of(scheduler: Scheduler, num_loading: int = 0) -> EngineCapacity:
    """``scheduler``'s seats and KV use now; ``num_loading``: requests added but not yet in the scheduler (their
    prefix loading from a KV tier), which will take seats."""
    usage = scheduler.kv_cache.usage
    free = 0 if usage > KV_NEARLY_FULL else max(0, scheduler.num_free_slots - num_loading)
    return EngineCapacity(scheduler.config.max_num_seqs, free, scheduler.num_running,
                          scheduler.num_waiting + num_loading, scheduler.num_waiting_new + num_loading, usage,
                          scheduler.prefill_backlog_tokens)


def stats_of(scheduler: Scheduler, batch_size: int, num_batched_tokens: int,
             kv_tiers: list[KVTierStats] | None = None, drafts: tuple[int, int, int] = (0, 0, 0)) -> EngineStats:
    """``scheduler``'s load per tier and counters since start, with the size of the last step that ran;
    ``drafts``: the draft tokens computed and kept since start, and the decode steps run without drafts where they
    were measured to lose (speculative decoding)."""
    running, waiting = scheduler.counts_by_priority()
    return EngineStats(
        running={_TIER_BY_PRIORITY.get(p, "other"): n for p, n in running.items()},
        waiting={_TIER_BY_PRIORITY.get(p, "other"): n for p, n in waiting.items()},
        kv_cache_usage=scheduler.kv_cache.usage,
        prefix_cache_queries=scheduler.prefix_cache_queries,
        prefix_cache_hits=scheduler.prefix_cache_hits,
        num_preemptions=scheduler.num_preemptions,
        num_pauses=scheduler.num_pauses,
        batch_size=batch_size,
        num_batched_tokens=num_batched_tokens,
        kv_tiers=kv_tiers or [],
        num_draft_tokens=drafts[0],
        num_accepted_draft_tokens=drafts[1],
        num_steps_without_drafts=drafts[2],
    )
