"""KV cache blocks: reference counts, an LRU free queue, and the map from block hash to cached block.

The pool knows only blocks; it never decides scheduling. A block with ``ref_count == 0`` sits in the free
queue even when it still holds a cached prefix: it is evicted (its hash forgotten) only when
``get_new_blocks`` hands it out again, so cached KV survives as long as memory is not needed::

    free queue   head ─▶ [never used] [no hash] [cached, LRU] ... [cached, MRU] ◀─ tail
                 get_new_blocks pops here                   free_blocks appends here
    cached map   block_hash ─▶ block_id  (full blocks only, in use or free)
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """One fixed-size page of KV cache.

    ``block_hash`` and ``token_ids`` are set once the block is full and registered in the prefix cache;
    ``token_ids`` lets a lookup verify the block's content, so a hash collision cannot serve wrong KV.
    """

    block_id: int
    ref_count: int = 0
    block_hash: int | None = None
    token_ids: tuple[int, ...] | None = None

    @property
    def is_cached(self) -> bool:
        return self.block_hash is not None


class BlockPool:
    """All ``num_blocks`` blocks of one KV cache.

    Raises only on programmer error (taking more blocks than are free, freeing an unreferenced block);
    callers check ``num_free_blocks`` first.
    """

    def __init__(self, num_blocks: int, record_events: bool = False) -> None:
        """``record_events``: keep the hashes registered and evicted since the last ``take_events`` (what a worker
        publishes as KV events, shared/kv_events.py)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(block_id=i) for i in range(num_blocks)]
        # OrderedDict as a linked list: O(1) pop at the head, append at the tail, and removal from the middle
        # when a prefix-cache hit revives a free block.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[int, int] = {}  # block_hash -> block_id
        self._stored: list[int] | None = [] if record_events else None
        self._removed: list[int] | None = [] if record_events else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks with no reference, including ones that still hold a cached prefix."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Full blocks registered in the prefix cache, referenced or not."""
        return len(self._cached)

    def get_new_blocks(self, num_blocks: int) -> list[Block]:
        """Take ``num_blocks`` from the head of the free queue with ``ref_count`` 1, evicting cached content."""
        if num_blocks > len(self._free):
            raise ValueError(f"asked for {num_blocks} blocks, only {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._evict(block)
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[Block]) -> None:
        """Add a reference to each block (a prefix-cache hit), taking free ones out of the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                del self._free[block.block_id]
            block.ref_count += 1

    def free_blocks(self, blocks: Iterable[Block]) -> None:
        """Drop one reference from each block, in the order given; unreferenced blocks become free.

        Callers pass a sequence's blocks tail first: a prefix is only useful from its start, so the tail
        should be evicted before the head. A block without a hash holds nothing reusable and goes to the
        head of the queue, so it is reused before any cached block is evicted.
        """
        for block in blocks:
            if block.ref_count <= 0:
                raise ValueError(f"block {block.block_id} freed with ref_count {block.ref_count}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block.block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def get_cached_block(self, block_hash: int, token_ids: tuple[int, ...]) -> Block | None:
        """The cached block with this hash and exactly these tokens, or None."""
        block_id = self._cached.get(block_hash)
        if block_id is None:
            return None
        block = self.blocks[block_id]
        if block.token_ids != token_ids:
            return None  # hash collision: never serve KV computed for other tokens
        return block

    def cache_full_block(self, block: Block, block_hash: int, token_ids: tuple[int, ...]) -> bool:
        """Register a full, referenced block under ``block_hash``; returns whether it was registered.

        When another block already holds this hash (two sequences computed the same prefix in the same
        step, or a collision) the first one stays: this block is left uncached and is reused first once freed.
        """
        if block.ref_count <= 0:
            raise ValueError(f"block {block.block_id} cached while unreferenced")
        if block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        block.token_ids = token_ids
        self._cached[block_hash] = block.block_id
        if self._stored is not None:
            self._stored.append(block_hash)
        return True

    def take_events(self) -> tuple[list[int], list[int]]:
        """The net change since the last call (with ``record_events``): hashes registered and held now, and hashes
        evicted and not held now (one registered and evicted again in between is only a removal, harmless to
        whoever never heard of it)."""
        if self._stored is None or self._removed is None:
            return [], []
        stored = [h for h in dict.fromkeys(self._stored) if h in self._cached]
        removed = [h for h in dict.fromkeys(self._removed) if h not in self._cached]
        self._stored, self._removed = [], []
        return stored, removed

    def cached_hashes(self) -> list[int]:
        """Every hash the pool holds now (a snapshot for KV events)."""
        return list(self._cached)

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None and self._cached.get(block.block_hash) == block.block_id:
            del self._cached[block.block_hash]
            if self._removed is not None:
                self._removed.append(block.block_hash)
        block.block_hash = None
        block.token_ids = None
