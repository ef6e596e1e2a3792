"""KVCacheManager: block tables, "does not fit" without side effects, prefix-cache hash chain and hits."""

from __future__ import annotations

import pytest

import switchyard.scheduler.kv_cache_manager as kv_module
from switchyard.scheduler import KVCacheManager, Sequence, hash_block


def computed(kv: KVCacheManager, seq: Sequence, num_new_tokens: int | None = None) -> list[int]:
    """Allocate for the whole (rest of the) sequence, as if the step ran, and cache its full blocks."""
    blocks, num_hit = kv.get_computed_blocks(seq)
    seq.num_computed_tokens += num_hit
    n = seq.num_uncomputed_tokens if num_new_tokens is None else num_new_tokens
    table = kv.allocate_slots(seq, n, blocks)
    assert table is not None
    seq.num_computed_tokens += n
    kv.cache_blocks(seq, seq.num_computed_tokens)
    return table


def test_hash_block_chains_parent_and_tokens() -> None:
    h0 = hash_block(None, (1, 2, 3, 4))
    assert h0 == hash_block(None, (1, 2, 3, 4))  # stable, not randomized per process
    assert h0 != hash_block(None, (1, 2, 3, 5))
    assert hash_block(h0, (5, 6, 7, 8)) != hash_block(None, (5, 6, 7, 8))
    assert hash_block(h0, (5, 6, 7, 8)) != hash_block(h0 + 1, (5, 6, 7, 8))
    assert hash_block(0, (1,)) != hash_block(None, (1,))


def test_allocate_grows_the_table_and_none_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    seq = Sequence("a", list(range(10)), max_tokens=8)
    assert kv.allocate_slots(seq, 6) == [0, 1]
    seq.num_computed_tokens = 6
    assert kv.allocate_slots(seq, 4) == [0, 1, 2]  # 10 tokens -> 3 blocks
    seq.num_computed_tokens = 10
    assert kv.can_allocate(seq, 6) and not kv.can_allocate(seq, 7)
    assert kv.allocate_slots(seq, 7) is None  # 17 tokens -> 5 blocks > 4
    assert kv.get_block_table("a") == [0, 1, 2] and kv.num_free_blocks == 1
    assert kv.usage == pytest.approx(0.75)
    kv.free(seq)
    assert kv.num_free_blocks == 4 and kv.get_block_table("a") == [] and kv.usage == 0.0


def test_second_sequence_shares_a_three_block_prefix() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=16)
    prefix = list(range(48))
    a = Sequence("a", prefix + [1000, 1001], max_tokens=4)
    table_a = computed(kv, a)
    b = Sequence("b", prefix + [2000, 2001, 2002], max_tokens=4)
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 48 and [blk.block_id for blk in blocks] == table_a[:3]
    table_b = kv.allocate_slots(b, b.num_tokens - num_hit, blocks)
    assert table_b is not None
    assert table_b[:3] == table_a[:3] and table_b[3] != table_a[3]
    assert [kv.pool.blocks[i].ref_count for i in table_b] == [2, 2, 2, 1]
    assert (kv.num_prefix_hit_tokens, kv.num_prefix_query_tokens) == (48, 50 + 51)
    kv.free(a)
    assert [kv.pool.blocks[i].ref_count for i in table_b] == [1, 1, 1, 1]


def test_hits_never_cover_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed(kv, Sequence("a", list(range(8)), max_tokens=1))
    _, num_hit = kv.get_computed_blocks(Sequence("b", list(range(8)), max_tokens=1))
    assert num_hit == 4  # the second block must be recomputed to produce logits
    _, num_hit = kv.get_computed_blocks(Sequence("c", list(range(9)), max_tokens=1))
    assert num_hit == 8


def test_hits_on_free_blocks_count_against_free_space() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    a = Sequence("a", list(range(13)), max_tokens=1)
    computed(kv, a)  # 4 blocks, 3 of them full and cached
    kv.free(a)
    assert kv.num_free_blocks == 4
    b = Sequence("b", list(range(17)), max_tokens=1)  # 5 blocks: can never fit
    blocks, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 12
    assert kv.allocate_slots(b, 5, blocks) is None
    assert kv.num_free_blocks == 4 and all(blk.ref_count == 0 for blk in blocks)
    c = Sequence("c", list(range(14)), max_tokens=1)  # 3 hits + 1 new block: exactly fits
    blocks, num_hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, c.num_tokens - num_hit, blocks) is not None
    assert kv.num_free_blocks == 0


def test_eviction_takes_the_tail_of_a_prefix_first_then_lru() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    a = Sequence("a", list(range(13)), max_tokens=1)
    assert computed(kv, a) == [0, 1, 2, 3]  # blocks 0-2 cached, 3 partial
    kv.free(a)
    other = Sequence("x", [500 + i for i in range(16)], max_tokens=1)
    # Takes the partial block 3 first, then never-used 4, 5, then evicts a's *last* full block 2.
    assert kv.allocate_slots(other, 16) == [3, 4, 5, 2]
    again = Sequence("a2", list(range(13)), max_tokens=1)
    blocks, num_hit = kv.get_computed_blocks(again)
    assert [blk.block_id for blk in blocks] == [0, 1] and num_hit == 8
    kv.free(other)
    y = Sequence("y", [900 + i for i in range(24)], max_tokens=1)
    assert kv.allocate_slots(y, 24) is not None  # all 6 blocks: evicts the rest of a's prefix
    assert kv.get_computed_blocks(Sequence("a3", list(range(13)), max_tokens=1)) == ([], 0)


def test_colliding_hashes_are_caught_by_token_verification(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_module, "hash_block", lambda parent, tokens, salt="": 1234)  # every block collides
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed(kv, Sequence("a", [1, 2, 3, 4, 5], max_tokens=1))
    assert kv.get_computed_blocks(Sequence("b", [9, 9, 9, 9, 5], max_tokens=1)) == ([], 0)
    blocks, num_hit = kv.get_computed_blocks(Sequence("c", [1, 2, 3, 4, 6], max_tokens=1))
    assert num_hit == 4 and blocks[0].token_ids == (1, 2, 3, 4)


def test_a_salt_scopes_the_whole_chain() -> None:
    """Same tokens, other salt: no block is found, the first or any later one (the salt is in the chain's root)."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    computed(kv, Sequence("a", list(range(13)), max_tokens=1, cache_salt="tenant:a"))
    assert kv.get_computed_blocks(Sequence("b", list(range(13)), max_tokens=1, cache_salt="tenant:b")) == ([], 0)
    assert kv.get_computed_blocks(Sequence("c", list(range(13)), max_tokens=1, cache_salt="tenant:a"))[1] == 12


def test_cache_blocks_registers_only_full_computed_blocks_incrementally() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = Sequence("a", list(range(6)), max_tokens=8)
    kv.allocate_slots(seq, 6)
    seq.num_computed_tokens = 6
    kv.cache_blocks(seq, 6)
    assert kv.pool.num_cached_blocks == 1
    for token in (6, 7):  # decode two tokens: the second block fills
        seq.append_token(token)
        kv.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        kv.cache_blocks(seq, seq.num_computed_tokens)
    assert kv.pool.num_cached_blocks == 2
    _, num_hit = kv.get_computed_blocks(Sequence("b", list(range(9)), max_tokens=1))
    assert num_hit == 8


def test_disabled_prefix_caching_never_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    computed(kv, Sequence("a", list(range(9)), max_tokens=1))
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(Sequence("b", list(range(9)), max_tokens=1)) == ([], 0)
    assert kv.num_prefix_query_tokens == 0


def test_hits_only_on_first_allocation() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    computed(kv, Sequence("a", list(range(9)), max_tokens=1))
    b = Sequence("b", list(range(9)), max_tokens=1)
    blocks, _ = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 1)
    with pytest.raises(ValueError):
        kv.allocate_slots(b, 1, blocks)
