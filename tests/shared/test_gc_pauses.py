"""A process's garbage-collector pauses: each collection shows in its histogram, by generation, until stopped;
what start-up made leaves the collector's walk."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry, Histogram

from switchyard.shared.gc_pauses import (
    GATEWAY_THRESHOLDS,
    GcPauses,
    freeze_startup_objects,
    pause_histogram,
    startup_frozen,
)


def _full_collections(histogram: Histogram) -> tuple[float, float]:
    """(count, sum) of the generation-2 series."""
    samples = {s.name: s.value for m in histogram.collect() for s in m.samples
               if s.labels.get("generation") == "2" and not s.name.endswith("_bucket")}
    return samples["switchyard:gc_pause_seconds_count"], samples["switchyard:gc_pause_seconds_sum"]


def test_each_full_collection_is_observed_until_stopped():
    metrics = pause_histogram(CollectorRegistry())
    pauses = GcPauses(metrics)
    pauses.start()
    try:
        # Something for the collection to walk, so its time is more than the clock's resolution.
        kept = [[i] for i in range(200_000)]
        gc.collect()
        count, seconds = _full_collections(metrics)
        assert count >= 1 and seconds > 0
    finally:
        pauses.stop()
    del kept
    gc.collect()
    assert _full_collections(metrics)[0] == count


@pytest.fixture
def unfrozen():
    thresholds = gc.get_threshold()
    yield
    gc.unfreeze()  # this test process goes on collecting what it froze
    gc.set_threshold(*thresholds)


def test_objects_alive_after_startup_leave_the_collectors_walk(unfrozen):
    kept = [[i] for i in range(50_000)]
    walked_before = len(gc.get_objects(generation=2))
    frozen = freeze_startup_objects()
    assert frozen >= len(kept)
    # A full collection now walks what is made from here on, not the 50,000 lists start-up left.
    assert len(gc.get_objects(generation=2)) < walked_before - len(kept)


async def test_a_gateway_freezes_its_start_up_and_collects_at_its_own_thresholds(unfrozen):
    async with startup_frozen():
        assert gc.get_threshold() == GATEWAY_THRESHOLDS and gc.get_freeze_count() > 0
