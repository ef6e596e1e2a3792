"""BlockPool: reference counts, LRU free queue, cached-block map, eviction on reuse."""

from __future__ import annotations

import pytest

from switchyard.scheduler import BlockPool


def test_new_blocks_come_from_the_head_with_one_reference() -> None:
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(3)
    assert [b.block_id for b in blocks] == [0, 1, 2]
    assert all(b.ref_count == 1 for b in blocks)
    assert pool.num_free_blocks == 1


def test_freed_cached_blocks_go_to_the_tail_and_uncached_to_the_head() -> None:
    pool = BlockPool(5)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, 100, (1,))
    pool.cache_full_block(b, 101, (2,))
    pool.free_blocks([c, b, a])  # a sequence frees tail first
    # c holds nothing reusable: reused before the never-used 3, 4; then the cached ones, b before a.
    assert [blk.block_id for blk in pool.get_new_blocks(5)] == [2, 3, 4, 1, 0]


def test_reuse_evicts_the_hash_and_lookup_then_misses() -> None:
    pool = BlockPool(1)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 7, (1, 2))
    pool.free_blocks([block])
    assert pool.get_cached_block(7, (1, 2)) is block  # freed but still cached
    assert pool.num_free_blocks == 1 and pool.num_cached_blocks == 1
    (again,) = pool.get_new_blocks(1)
    assert again is block and block.block_hash is None and block.token_ids is None
    assert pool.get_cached_block(7, (1, 2)) is None
    assert pool.num_cached_blocks == 0


def test_touch_revives_a_free_cached_block() -> None:
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    pool.cache_full_block(block, 7, (1,))
    pool.free_blocks([block])
    assert pool.num_free_blocks == 3
    pool.touch([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 2
    pool.touch([block])  # a second sharer: no queue change
    assert block.ref_count == 2 and pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert block.ref_count == 1 and pool.num_free_blocks == 2
    # The revived block is never handed out while referenced.
    assert block not in pool.get_new_blocks(2)


def test_hash_collision_never_returns_other_tokens() -> None:
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, 42, (1, 2, 3))
    assert pool.get_cached_block(42, (9, 9, 9)) is None
    assert pool.get_cached_block(42, (1, 2, 3)) is a
    # Same hash again (collision, or the same prefix computed twice): the first block keeps the entry.
    assert not pool.cache_full_block(b, 42, (1, 2, 3))
    assert b.block_hash is None and pool.num_cached_blocks == 1


@pytest.mark.parametrize("misuse", ["double_free", "too_many", "cache_free_block"])
def test_programmer_errors_raise(misuse: str) -> None:
    pool = BlockPool(2)
    (block,) = pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        if misuse == "double_free":
            pool.free_blocks([block, block])
        elif misuse == "too_many":
            pool.get_new_blocks(2)
        else:
            pool.free_blocks([block])
            pool.cache_full_block(block, 1, (1,))
