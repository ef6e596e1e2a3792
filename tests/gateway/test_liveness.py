"""The gateway's view of worker liveness pings on a real NATS server (gateway/liveness.py): the seats a ping
offers are believed through one late ping, not through two missed ones."""

from __future__ import annotations

import asyncio
import time

import nats

from switchyard.gateway import liveness
from switchyard.gateway.liveness import ALIVE_INTERVAL_S, WorkerLiveness
from switchyard.shared import subjects


async def test_a_pings_free_seats_hold_through_one_late_ping_not_two_missed(nats_url, monkeypatch):
    nc = await nats.connect(nats_url)
    try:
        seen = WorkerLiveness()
        await seen.start(nc)
        await nc.publish(f"{subjects.ALIVE_PREFIX}.w1", b"3")
        await nc.flush()
        for _ in range(100):
            if seen.free_seats("w1") == 3:
                break
            await asyncio.sleep(0.01)
        pinged = time.monotonic()
        monkeypatch.setattr(liveness.time, "monotonic", lambda: pinged + 2 * ALIVE_INTERVAL_S)  # one ping late
        assert seen.free_seats("w1") == 3 and not seen.is_dead("w1")
        monkeypatch.setattr(liveness.time, "monotonic", lambda: pinged + 2.6 * ALIVE_INTERVAL_S)  # two missed
        assert seen.free_seats("w1") == 0 and seen.free_seats("never-pinged") == 0
    finally:
        monkeypatch.undo()  # the clock is the whole process's (the event loop's too)
        await nc.close()
