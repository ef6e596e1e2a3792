"""How full the vLLM engine is, in the interface's terms (``EngineCapacity``, ``EngineStats``).

    vLLM, after each step ──▶ a stat logger of ours (``StepStats``, given to vLLM as a stat-logger factory): its
                              SchedulerStats (running, waiting, KV use, prefix-cache queries and hits) and
                              IterationStats (preemptions), kept and summed
    the engine's choices ───▶ which are in vLLM, started or not, by tier (the engine knows them, vLLM's stats
                              do not)
                          ───▶ capacity_of / stats_of

Seats are counted from the engine's own choices, not from vLLM's stats (which are as old as the last step, and
absent when no step ran): a seat is free when fewer choices than ``max_num_seqs`` are in vLLM or waiting to join it,
and none is while the KV cache is nearly full (the threshold our engine uses too).
"""

from __future__ import annotations

from dataclasses import dataclass

from switchyard.workers.serving.stats import KV_NEARLY_FULL, EngineCapacity, EngineStats


@dataclass(slots=True)
class StepStats:
    """What vLLM reported after its last step, and its counters since start."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    batch_size: int = 0
    num_batched_tokens: int = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        """vLLM's stats of one step (``StatLoggerBase.record``'s arguments)."""
        if scheduler_stats is not None:
            self.num_running = scheduler_stats.num_running_reqs
            self.num_waiting = scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs
            self.kv_cache_usage = scheduler_stats.kv_cache_usage
            prefix = scheduler_stats.prefix_cache_stats
            if prefix is not None:
                self.prefix_cache_queries += prefix.queries
                self.prefix_cache_hits += prefix.hits
            self.batch_size = scheduler_stats.num_running_reqs
        if iteration_stats is not None:
            self.num_preemptions += iteration_stats.num_preempted_reqs
            self.num_batched_tokens = iteration_stats.num_generation_tokens + iteration_stats.num_prompt_tokens


def stat_logger_factory(stats: StepStats):
    """A vLLM stat-logger class that records into ``stats`` (vLLM builds it as ``factory(vllm_config, index)``)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class _Recorder(StatLoggerBase):
        def __init__(self, vllm_config, engine_index: int = 0) -> None:
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            stats.record(scheduler_stats, iteration_stats)

        def log_engine_initialized(self) -> None:
            pass

    return _Recorder


def capacity_of(stats: StepStats, max_num_seqs: int, num_in_engine: int, num_not_started: int) -> EngineCapacity:
    """Seats and KV use now: ``num_in_engine`` choices are in vLLM or waiting to join it, ``num_not_started`` of them
    have produced no token yet."""
    kv = stats.kv_cache_usage if num_in_engine else 0.0  # nothing held: whatever vLLM said last is past
    running = min(stats.num_running, num_in_engine - num_not_started) if num_in_engine else 0
    free = 0 if kv > KV_NEARLY_FULL else max(0, max_num_seqs - num_in_engine)
    return EngineCapacity(max_num_seqs, free, running, num_in_engine - running, num_not_started, kv)


def stats_of(stats: StepStats, running: dict[str, int], waiting: dict[str, int], holds_any: bool) -> EngineStats:
    """The engine's load per tier (from its choices) and vLLM's counters; ``holds_any``: a choice is in vLLM (else
    its last KV use is past: aborted and finished requests free their blocks)."""
    return EngineStats(running=running, waiting=waiting, kv_cache_usage=stats.kv_cache_usage if holds_any else 0.0,
                       prefix_cache_queries=stats.prefix_cache_queries, prefix_cache_hits=stats.prefix_cache_hits,
                       num_preemptions=stats.num_preemptions, batch_size=stats.batch_size,
                       num_batched_tokens=stats.num_batched_tokens)
