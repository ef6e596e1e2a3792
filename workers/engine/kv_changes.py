"""What our engine's KV cache gained and lost since the worker last asked: the content of its KV events.

    pool (scheduler/block_pool.py) ─── net registered / evicted hashes ──┐
    tiers (workers/kv_tiers/)      ─── blocks written / removed ──────────┼─▶ take() ─▶ KVChanges ─▶ the worker
    prepared chat requests         ─── their message prefixes' blocks ────┘     publishes (shared/kv_events.py)

Each message prefix is handed out once (a conversation sends its history every turn): a bounded set remembers the
keys already handed out, and a router that missed one learns it from the next request that carries it.
"""

from __future__ import annotations

from collections import OrderedDict

import msgspec

from switchyard.scheduler.block_pool import BlockPool
from switchyard.shared.kv_events import POOL, PrefixSegment
from switchyard.workers.engine.tiered_prefixes import TieredPrefixes

_KEYS_REMEMBERED = 65_536


class KVChanges(msgspec.Struct):
    """Block hashes (the scheduler's ints) stored and removed per tier (``pool``, ``host``, ``disk``) and the
    message-prefix segments of requests added, since the last ``take``."""

    block_size: int
    stored: dict[str, list[int]] = msgspec.field(default_factory=dict)
    removed: dict[str, list[int]] = msgspec.field(default_factory=dict)
    prefixes: list[PrefixSegment] = msgspec.field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not (any(self.stored.values()) or any(self.removed.values()) or self.prefixes)


class PrefixSegmentLog:
    """The message-prefix segments of requests added since the last ``take``, each key handed out once (see the
    module docstring); both engines' KV changes carry them."""

    def __init__(self) -> None:
        self._segments: list[PrefixSegment] = []
        self._handed_out: OrderedDict[bytes, None] = OrderedDict()

    def add(self, segments: list[PrefixSegment]) -> None:
        for segment in segments:
            if segment.key in self._handed_out:
                self._handed_out.move_to_end(segment.key)
                continue
            self._handed_out[segment.key] = None
            self._segments.append(segment)
        while len(self._handed_out) > _KEYS_REMEMBERED:
            self._handed_out.popitem(last=False)

    def take(self) -> list[PrefixSegment]:
        segments, self._segments = self._segments, []
        return segments


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
