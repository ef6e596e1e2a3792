"""What our engine's KV cache gained and lost since the worker last asked (``KVChanges``):

    pool (scheduler/block_pool.py) ─── net registered / evicted hashes ──┐
    tiers (workers/kv_tiers/)      ─── blocks written / removed ──────────┼─▶ take() ─▶ KVChanges ─▶ the worker
    prepared chat requests         ─── their message prefixes' blocks ────┘     publishes (shared/kv_events.py)
"""

from __future__ import annotations

from switchyard.scheduler.block_pool import BlockPool
from switchyard.shared.kv_events import POOL, PrefixSegment
from switchyard.workers.engine.tiered_prefixes import TieredPrefixes
from switchyard.workers.serving.kv_changes import KVChanges, PrefixSegmentLog


class KVChangeLog:
    """Collects an engine's KV changes between two ``take`` calls (all on the step thread but ``listing``)."""

    def __init__(self, block_size: int, pool: BlockPool, tiers: TieredPrefixes | None) -> None:
        self._block_size = block_size
        self._pool = pool
        self._tiers = tiers
        self._prefixes = PrefixSegmentLog()

    def add_prefixes(self, segments: list[PrefixSegment]) -> None:
        self._prefixes.add(segments)

    def take(self) -> KVChanges:
        stored, removed = self._pool.take_events()
        changes = KVChanges(self._block_size, {POOL: stored}, {POOL: removed}, self._prefixes.take())
        if self._tiers is not None:
            for tier, (tier_stored, tier_removed) in self._tiers.tiers.take_events().items():
                changes.stored[tier] = tier_stored
                changes.removed[tier] = tier_removed
        return changes

    def listing(self) -> dict[str, list[int]]:
        """Every block held now, per tier: a snapshot. Safe off the step thread (copies made under the GIL)."""
        held = {POOL: self._pool.cached_hashes()}
        if self._tiers is not None:
            held.update(self._tiers.tiers.listing())
        return held
