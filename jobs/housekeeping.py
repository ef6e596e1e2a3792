"""Periodic upkeep: lowered queue caps step toward their target as queues drain (and queue ages follow the tiers'
waits), old rate-limit windows go, background responses a crashed gateway left are failed."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from switchyard.domain.limits import Limiter
from switchyard.domain.responses import fail_abandoned
from switchyard.shared.tier_store import read_policies, reconcile_queue_limits

log = logging.getLogger("switchyard.housekeeping")

PRUNE_EVERY_ROUNDS = 300  # rounds of a second: rate-limit windows are pruned every five minutes
ABANDONED_EVERY_ROUNDS = 30  # background responses no gateway runs any more, looked for every half minute


async def run_housekeeping(js, limiter: Limiter, stop: asyncio.Event, pool=None) -> None:
    """Every second: move lowered queue caps toward their target (see ``shared.tier_store.apply_queue_limits``);
    every half minute: fail background responses no gateway runs (with ``pool``); every few minutes: drop old
    rate-limit windows.
    Until ``stop``."""
    rounds = 0
    while not stop.is_set():
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)
        rounds += 1
        try:
            await reconcile_queue_limits(js, await read_policies(js))
            if rounds % PRUNE_EVERY_ROUNDS == 0:
                await limiter.prune()
            if pool is not None and rounds % ABANDONED_EVERY_ROUNDS == 0:
                await fail_abandoned(pool)
        except Exception as exc:  # NATS or Postgres reconnecting: next round
            log.warning("housekeeping failed: %s", exc)
