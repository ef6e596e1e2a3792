"""The event-loop lag probe: a loop held up shows in the gateway's metric; an idle one does not."""

from __future__ import annotations

import asyncio
import time

from switchyard.gateway.loop_lag import LoopLagProbe
from switchyard.gateway.metrics import GatewayMetrics


def _observed(metrics: GatewayMetrics) -> tuple[float, float]:
    """(observations, their sum) of the lag histogram."""
    samples = {s.name: s.value for m in metrics.loop_lag.collect() for s in m.samples}
    return samples["switchyard:event_loop_lag_seconds_count"], samples["switchyard:event_loop_lag_seconds_sum"]


async def _ticks(metrics: GatewayMetrics, at_least: int) -> None:
    while _observed(metrics)[0] < at_least:
        await asyncio.sleep(0.01)


async def test_a_loop_held_up_shows_as_lag():
    metrics = GatewayMetrics()
    probe = LoopLagProbe(metrics.loop_lag, interval_s=0.05)
    probe.start()
    try:
        await asyncio.wait_for(_ticks(metrics, 1), 10)
        count, before = _observed(metrics)
        time.sleep(0.4)  # a callback that blocks the loop, as a CPU-bound handler would
        await asyncio.wait_for(_ticks(metrics, count + 1), 10)
        # The probe's timer was due at most 0.05 s into the block: it fired at least 0.35 s late.
        assert _observed(metrics)[1] - before >= 0.35
    finally:
        await probe.stop()


async def test_the_probe_stops_with_the_gateway():
    metrics = GatewayMetrics()
    probe = LoopLagProbe(metrics.loop_lag, interval_s=0.01)
    probe.start()
    await asyncio.wait_for(_ticks(metrics, 2), 10)
    await probe.stop()
    count = _observed(metrics)[0]
    await asyncio.sleep(0.05)
    assert _observed(metrics)[0] == count
