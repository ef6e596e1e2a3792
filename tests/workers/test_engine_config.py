"""Settings travel whole: the worker's engine section reaches the engine, and the engine's config the scheduler, by
field name (no model needed)."""

from __future__ import annotations

from dataclasses import fields

import pytest

from switchyard.scheduler import SchedulerConfig
from switchyard.shared.config import EngineSettings, WorkerConfig
from switchyard.workers.engine.config import EngineConfig


def test_every_engine_setting_reaches_the_engine_config():
    settings = WorkerConfig(max_num_seqs=7, max_num_batched_tokens=96, block_size=32, kv_cache_gib=1.5,
                            gpu_memory_fraction=0.5, enable_prefix_caching=False, cuda_graphs=False)
    config = EngineConfig.from_settings(settings)
    names = {f.name for f in fields(EngineConfig)}
    for name in set(EngineSettings.model_fields) - {"kv_cache_gib"}:
        assert name in names and getattr(config, name) == getattr(settings, name), name
    assert config.kv_cache_bytes == int(1.5 * 2**30)
    assert EngineConfig.from_settings(WorkerConfig()).kv_cache_bytes is None


def test_the_scheduler_gets_the_fields_it_shares_with_the_engine_config():
    config = EngineConfig(max_num_seqs=8, max_num_batched_tokens=4, block_size=4, enable_prefix_caching=False)
    sched = config.scheduler_config(num_blocks=64, max_model_len=128, background_priority=3)
    assert (sched.max_num_seqs, sched.block_size, sched.enable_prefix_caching) == (8, 4, False)
    assert sched.max_num_batched_tokens == 8, "at least one token per sequence"
    assert (sched.num_blocks, sched.max_model_len, sched.background_priority) == (64, 128, 3)
    assert sched.long_prefill_token_threshold == SchedulerConfig().long_prefill_token_threshold


def test_the_engine_is_chosen_by_name_and_an_unknown_name_is_refused_with_the_known_ones():
    import pydantic

    from switchyard.shared.config import SwitchyardConfig, WorkerConfig
    from switchyard.workers.service.engines import ENGINES, engine_builder

    assert SwitchyardConfig().worker.engine == "switchyard"
    assert engine_builder("switchyard") is ENGINES["switchyard"]
    with pytest.raises(pydantic.ValidationError, match="switchyard"):
        WorkerConfig(engine="no-such-engine")
