from __future__ import annotations

import pytest

from kvfleet.engine.block_pool import BlockPool

ROOT = b"root"


def test_allocate_and_free_account_for_every_block() -> None:
    pool = BlockPool(4)
    blocks = pool.allocate(3)
    assert len(set(blocks)) == 3
    assert (pool.num_free_blocks, pool.num_allocated_blocks, pool.usage) == (1, 3, 0.75)
    pool.free(blocks)
    assert (pool.num_free_blocks, pool.usage) == (4, 0.0)
    pool.check_invariants()


def test_allocating_more_than_free_is_refused() -> None:
    pool = BlockPool(2)
    with pytest.raises(RuntimeError, match="asked for 3 blocks with 2 free"):
        pool.allocate(3)


def test_double_free_is_detected() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(RuntimeError, match="freed more often than allocated"):
        pool.free([block])


def test_shared_block_returns_to_free_queue_only_after_last_reference() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.touch([block])
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2


def test_cached_free_block_can_be_revived_by_a_hit() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache_block(block, b"h", ROOT, (1, 2))
    pool.free([block])
    assert pool.lookup(b"h") == block and pool.num_free_blocks == 2
    pool.touch([block])
    assert pool.blocks[block].ref_count == 1 and pool.num_free_blocks == 1
    pool.check_invariants()


def test_uncached_blocks_are_handed_out_before_cached_ones_are_evicted() -> None:
    pool = BlockPool(3)
    a, b, _c = pool.allocate(3)
    pool.cache_block(a, b"a", ROOT, (1, 2))
    pool.free([a])
    pool.free([b])  # no hash: goes to the front
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"a") == a


def test_cached_blocks_are_evicted_least_recently_freed_first() -> None:
    pool = BlockPool(3)
    a, b, c = pool.allocate(3)
    for block, h in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.cache_block(block, h, ROOT, (1, 2))
    pool.free([b])
    pool.free([a])
    pool.free([c])
    assert pool.allocate(1) == [b]
    assert pool.lookup(b"b") is None  # evicted with its block
    assert pool.lookup(b"a") == a and pool.lookup(b"c") == c
    pool.check_invariants()


def test_a_hash_maps_to_one_block() -> None:
    pool = BlockPool(2)
    a, b = pool.allocate(2)
    pool.cache_block(a, b"same", ROOT, (1, 2))
    pool.cache_block(b, b"same", ROOT, (1, 2))
    assert pool.lookup(b"same") == a and pool.blocks[b].block_hash is None
    assert pool.num_cached_blocks == 1


def test_reset_prefix_cache_forgets_every_hash() -> None:
    pool = BlockPool(2)
    (a,) = pool.allocate(1)
    pool.cache_block(a, b"h", ROOT, (1, 2))
    assert pool.reset_prefix_cache() == 1
    assert pool.lookup(b"h") is None
    pool.check_invariants()


def test_partial_match_finds_the_cached_child_sharing_the_most_leading_tokens() -> None:
    pool = BlockPool(4)
    a, b, c, _d = pool.allocate(4)
    pool.cache_block(a, b"a", ROOT, (5, 6, 7, 8))
    pool.cache_block(b, b"b", ROOT, (5, 6, 9, 9))
    pool.cache_block(c, b"c", b"other parent", (5, 6, 7, 8))
    assert pool.longest_partial_match(ROOT, (5, 6, 7, 1)) == (a, 3)
    assert pool.longest_partial_match(ROOT, (5, 6, 9)) == (b, 3)
    assert pool.longest_partial_match(ROOT, (4, 6, 7)) == (None, 0)
    assert pool.longest_partial_match(ROOT, ()) == (None, 0)
    pool.free([a])
    pool.allocate(1)  # the only free block: `a` is evicted, and leaves the index
    assert pool.longest_partial_match(ROOT, (5, 6, 7, 1)) == (b, 2)
    pool.check_invariants()
    pool.reset_prefix_cache()
    assert pool.longest_partial_match(ROOT, (5, 6, 9)) == (None, 0)
    pool.check_invariants()


def test_pool_needs_at_least_one_block() -> None:
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0)
