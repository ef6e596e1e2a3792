"""Per-sequence block tables over a ``BlockPool``, with prefix caching by a hash chain over full blocks.

A sequence's block ``i`` holds the KV of tokens ``[i * block_size, (i + 1) * block_size)``. Once full, it is
registered under a hash of its tokens *and its parent block's hash*, so equal hashes mean equal prefixes::

    tokens   [ 0..15 ][ 16..31 ][ 32..47 ][ 48..52 ]
    hashes     h0 ──▶   h1 ──▶    h2        (not full: never cached)
               h0 = H(None, t0..15)   h1 = H(h0, t16..31)   h2 = H(h1, t32..47)

Allocation never raises for lack of memory: ``allocate_slots`` returns None ("does not fit") and changes
nothing, and the scheduler decides whom to preempt.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Iterable
from collections.abc import Sequence as Seq
from typing import NamedTuple

from switchyard.scheduler.block_pool import Block, BlockPool
from switchyard.scheduler.request import Sequence


def hash_block(parent_hash: int | None, token_ids: tuple[int, ...], salt: str = "") -> int:
    """Hash of a full block given its parent's hash (None for the first block).

    ``salt`` (the sequence's ``cache_salt``) goes into the first block's hash, so the whole chain differs between
    salts: a prefix is shared only between sequences of one salt, and ``cached_tokens`` cannot tell one tenant
    what another tenant's prompts were.

    blake2b-128 rather than ``hash()``: it is stable across processes, and a collision would let one
    request read another's KV, so it must be infeasible to craft one, not just unlikely by chance.
    """
    h = hashlib.blake2b(digest_size=16)
    # The tag byte keeps "no parent" and "some parent" encodings from ever producing the same bytes; the salt's
    # length prefix keeps salt bytes from passing for token bytes.
    if parent_hash is None:
        salted = salt.encode()
        h.update(b"\x00" + len(salted).to_bytes(4, "little") + salted)
    else:
        h.update(b"\x01" + parent_hash.to_bytes(16, "little"))
    h.update(array("q", token_ids).tobytes())
    return int.from_bytes(h.digest(), "little")


def hash_chain(token_ids: Seq[int], block_size: int, salt: str, num_blocks: int, parent: int | None = None,
               ) -> list[int]:
    """Hashes of the first ``num_blocks`` full blocks of ``token_ids``, chained from ``parent`` (None: from the
    start of a sequence, where ``salt`` goes in)."""
    hashes = []
    for i in range(num_blocks):
        parent = hash_block(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]), salt)
        hashes.append(parent)
    return hashes


class CachedBlock(NamedTuple):
    """A block just registered in the prefix cache: where it is, what it holds, and whose it is."""

    block_id: int
    block_hash: int
    token_ids: tuple[int, ...]
    cache_salt: str


class KVCacheManager:
    """Owns the ``BlockPool`` and each sequence's block table; knows blocks, not scheduling."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_cached: bool = False, record_events: bool = False) -> None:
        """``record_cached``: keep a list of the blocks registered in the prefix cache (``take_newly_cached``), for
        an engine that copies them to a tier below the pool. ``record_events``: keep the pool's net changes
        (``pool.take_events``), for an engine that publishes KV events."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, record_events=record_events)
        self._tables: dict[str, list[Block]] = {}
        self._block_ids: dict[str, list[int]] = {}  # mirrors _tables, so a step copies ids instead of mapping
        self._hashes: dict[str, list[int]] = {}  # hash chain of the sequence's full blocks, extended lazily
        self._num_registered: dict[str, int] = {}  # leading blocks already offered to the prefix cache
        # Metrics: prefix-cache hit rate = hit / query, counted once per admission.
        self.num_prefix_hit_tokens = 0
        self.num_prefix_query_tokens = 0
        self._newly_cached: list[CachedBlock] | None = [] if record_cached else None

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by some sequence (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return -(-num_tokens // self.block_size)

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[Block], int]:
        """The longest run of cached blocks matching ``seq`` from its first token, and their token count.

        At most ``(num_tokens - 1) // block_size`` blocks: at least one token must still be computed so the
        model produces logits to sample from. The blocks are not referenced until ``allocate_slots``.
        """
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = self._hashes.setdefault(seq.seq_id, [])
        blocks: list[Block] = []
        for i in range(max_blocks):
            token_ids = self._block_tokens(seq, i)
            if i == len(hashes):
                hashes.append(hash_block(hashes[i - 1] if i else None, token_ids, seq.cache_salt))
            block = self.pool.get_cached_block(hashes[i], token_ids)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def block_hash(self, seq: Sequence, index: int) -> int:
        """Hash of ``seq``'s full block ``index`` (its chain computed as far as needed, and kept)."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        while len(hashes) <= index:
            i = len(hashes)
            hashes.append(hash_block(hashes[i - 1] if i else None, self._block_tokens(seq, i), seq.cache_salt))
        return hashes[index]

    def is_prefix_in_flight(self, seq: Sequence, running: Iterable[Sequence]) -> bool:
        """True when one of ``running`` is computing ``seq``'s next uncached full block right now (the same
        prefix: a burst of requests sharing a system prompt). Admitting ``seq`` in the same step would compute
        that prefix a second time; waiting a step makes it a prefix-cache hit."""
        if not self.enable_prefix_caching:
            return False
        bs = self.block_size
        _, num_hit = self.get_computed_blocks(seq)
        index = num_hit // bs
        if (index + 1) * bs > seq.num_tokens - 1:
            return False  # no further full block it could share
        wanted = self.block_hash(seq, index)
        return any(
            other.num_computed_tokens <= index * bs and (index + 1) * bs <= other.num_prompt_tokens
            and self.block_hash(other, index) == wanted
            for other in running
        )

    def can_allocate(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[Block] = ()) -> bool:
        """Whether ``allocate_slots`` with the same arguments would succeed."""
        return self._fits(self._num_new_blocks(seq, num_new_tokens, computed_blocks), computed_blocks)

    def allocate_slots(
        self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[Block] = ()
    ) -> list[int] | None:
        """Make ``seq`` own blocks for ``num_computed_tokens + hit tokens + num_new_tokens`` tokens.

        ``computed_blocks`` are the hits from ``get_computed_blocks``, passed on the sequence's first
        allocation only; they get a reference here. Returns a copy of the full block table (block ids), or
        None when the blocks do not fit, in which case nothing changed.
        """
        table = self._tables.get(seq.seq_id)
        if computed_blocks and table is not None:
            raise ValueError(f"sequence {seq.seq_id!r} already has blocks; hits apply to the first allocation")
        num_new_blocks = self._num_new_blocks(seq, num_new_tokens, computed_blocks)
        if table is not None and num_new_blocks <= 0:
            return list(self._block_ids[seq.seq_id])  # the common decode step: room left in the last block
        if not self._fits(num_new_blocks, computed_blocks):
            return None
        if table is None:
            table = self._tables[seq.seq_id] = []
            self._block_ids[seq.seq_id] = []
            self._num_registered[seq.seq_id] = len(computed_blocks)  # hits are cached already
            if self.enable_prefix_caching:
                self.num_prefix_query_tokens += seq.num_tokens
                self.num_prefix_hit_tokens += len(computed_blocks) * self.block_size
        block_ids = self._block_ids[seq.seq_id]
        if computed_blocks:
            self.pool.touch(computed_blocks)
            table.extend(computed_blocks)
            block_ids.extend(b.block_id for b in computed_blocks)
        if num_new_blocks > 0:
            new_blocks = self.pool.get_new_blocks(num_new_blocks)
            table.extend(new_blocks)
            block_ids.extend(b.block_id for b in new_blocks)
        return list(block_ids)

    def cache_blocks(self, seq: Sequence, num_computed_tokens: int) -> None:
        """Register the blocks of ``seq`` that ``num_computed_tokens`` has filled in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq.seq_id)
        if table is None:
            return
        num_full = min(num_computed_tokens // self.block_size, len(table))
        start = self._num_registered[seq.seq_id]
        if num_full <= start:
            return
        hashes = self._hashes.setdefault(seq.seq_id, [])
        for i in range(start, num_full):
            token_ids = self._block_tokens(seq, i)
            if i == len(hashes):
                hashes.append(hash_block(hashes[i - 1] if i else None, token_ids, seq.cache_salt))
            if self.pool.cache_full_block(table[i], hashes[i], token_ids) and self._newly_cached is not None:
                self._newly_cached.append(CachedBlock(table[i].block_id, hashes[i], token_ids, seq.cache_salt))
        self._num_registered[seq.seq_id] = num_full

    def take_newly_cached(self) -> list[CachedBlock]:
        """The blocks registered since the last call (with ``record_cached``), in registration order. Their KV
        stays put until the sequences holding them are freed, so a caller copies it before the next step."""
        taken = self._newly_cached or []
        if self._newly_cached:
            self._newly_cached = []
        return taken

    def chain(self, seq: Sequence) -> list[tuple[int, tuple[int, ...]]]:
        """``(hash, token ids)`` of each full block a prefix lookup for ``seq`` may hit (as ``get_computed_blocks``:
        all but the last token). Kept nowhere: ``seq`` need not be in the cache's care yet."""
        num_blocks = (seq.num_tokens - 1) // self.block_size
        hashes = hash_chain(seq.token_ids, self.block_size, seq.cache_salt, num_blocks)
        return [(h, self._block_tokens(seq, i)) for i, h in enumerate(hashes)]

    def num_cached_prefix_blocks(self, chain: Seq[tuple[int, tuple[int, ...]]]) -> int:
        """How many leading blocks of ``chain`` the pool holds now."""
        for i, (block_hash, token_ids) in enumerate(chain):
            if self.pool.get_cached_block(block_hash, token_ids) is None:
                return i
        return len(chain)

    def import_blocks(self, chain: Seq[tuple[int, tuple[int, ...]]], start: int) -> list[int]:
        """Register ``chain[start:]``, blocks whose KV the caller copies in from below the pool, after the pool's own
        ``chain[:start]``: each takes a free block (evicting the least recently used cached one) and is cached
        unreferenced near the most recently used end, so the next prefix lookup hits the whole chain. Returns the
        block ids to copy into, one per block imported, in order.

        The chain's head stays referenced meanwhile, so no import evicts it; at most as many blocks are imported as
        are free, so none evicts another; a block whose hash the pool already holds ends the import."""
        head = [self.pool.get_cached_block(h, t) for h, t in chain[:start]]
        if any(b is None for b in head):
            return []  # the head was evicted since it was looked up: the import would be unreachable
        held = [b for b in head if b is not None]
        self.pool.touch(held)
        imported: list[Block] = []
        try:
            for block_hash, token_ids in chain[start : start + self.pool.num_free_blocks]:
                block = self.pool.get_new_blocks(1)[0]
                if not self.pool.cache_full_block(block, block_hash, token_ids):
                    self.pool.free_blocks([block])
                    break
                imported.append(block)
        finally:
            self.pool.free_blocks(reversed(held + imported))  # tail first, as a sequence's blocks are freed
        return [b.block_id for b in imported]

    def free(self, seq: Sequence) -> None:
        """Release all of ``seq``'s blocks, tail first so its tail is evicted before its shared head."""
        table = self._tables.pop(seq.seq_id, None)
        self._block_ids.pop(seq.seq_id, None)
        self._hashes.pop(seq.seq_id, None)
        self._num_registered.pop(seq.seq_id, None)
        if table:
            self.pool.free_blocks(reversed(table))

    def get_block_table(self, seq_id: str) -> list[int]:
        """A copy of the sequence's block ids (empty when it holds none)."""
        return list(self._block_ids.get(seq_id, ()))

    def get_num_blocks(self, seq_id: str) -> int:
        return len(self._tables.get(seq_id, ()))

    def _num_new_blocks(self, seq: Sequence, num_new_tokens: int, computed_blocks: Seq[Block]) -> int:
        """Blocks to take from the free queue (<= 0: the sequence already owns enough)."""
        num_tokens = seq.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        num_owned = len(self._tables.get(seq.seq_id, ())) + len(computed_blocks)
        return -(-num_tokens // self.block_size) - num_owned

    def _fits(self, num_new_blocks: int, computed_blocks: Seq[Block]) -> bool:
        # Hits on free blocks leave the free queue when touched, so they cannot also serve as new blocks.
        num_revived = sum(1 for b in computed_blocks if b.ref_count == 0) if computed_blocks else 0
        return num_new_blocks <= self.pool.num_free_blocks - num_revived

    def _block_tokens(self, seq: Sequence, index: int) -> tuple[int, ...]:
        start = index * self.block_size
        return tuple(seq.token_ids[start : start + self.block_size])
