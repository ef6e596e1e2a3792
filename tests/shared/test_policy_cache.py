"""The per-process tier policy cache (shared/tier_store.py): a change this process made is what its next request
sees, even while a read begun before the change is still out."""

from __future__ import annotations

import asyncio

import msgspec

from switchyard.shared import tier_store
from switchyard.shared.tiers import DEFAULT_POLICIES


async def test_a_read_begun_before_a_change_does_not_hide_it(monkeypatch):
    before = dict(DEFAULT_POLICIES)
    after = {**before, "enterprise": msgspec.structs.replace(before["enterprise"], hedge_after_ms=300)}
    store = {"policies": before}
    first_read_out, release_first = asyncio.Event(), asyncio.Event()
    reads = 0

    async def read_policies(js):
        nonlocal reads
        reads += 1
        read = store["policies"]  # what the bucket held when the read reached it
        if reads == 1:
            first_read_out.set()
            await release_first.wait()
        return read

    monkeypatch.setattr(tier_store, "read_policies", read_policies)
    cache = tier_store.PolicyCache(js=None)  # type: ignore[arg-type]
    slow = asyncio.create_task(cache.get())  # a request's read, begun before the change
    await first_read_out.wait()
    store["policies"] = after  # the admin API writes the change, then:
    cache.invalidate()
    fresh = asyncio.create_task(cache.get())  # the next request
    await asyncio.sleep(0)
    release_first.set()
    await slow
    assert (await fresh)["enterprise"].hedge_after_ms == 300
    assert (await cache.get())["enterprise"].hedge_after_ms == 300  # and the old read did not overwrite it
