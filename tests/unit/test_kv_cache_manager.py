from __future__ import annotations

import pytest
from engine_fakes import make_request

from kvfleet.engine.kv_cache_manager import NO_HIT, KVCacheManager, PrefixHit, make_cache_salt
from kvfleet.engine.request import Request


def admit(kv: KVCacheManager, request_id: str, prompt: list[int],
          salt: str = "t") -> tuple[Request, PrefixHit]:
    """Admit a fresh request through the prefix cache, compute its prompt, index it."""
    request = make_request(request_id, prompt, cache_salt=salt)
    hit = kv.find_prefix_hit(request)
    kv.allocate(request, request.num_tokens - hit.num_tokens, hit)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return request, hit


def test_block_table_grows_block_by_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    request = make_request("r", 5)
    kv.allocate(request, 5)
    assert len(kv.block_ids("r")) == 2
    request.num_computed_tokens = 5
    kv.allocate(request, 3)  # positions 5..7 still fit block 1
    assert len(kv.block_ids("r")) == 2
    request.num_computed_tokens = 8
    kv.allocate(request, 1)
    assert len(kv.block_ids("r")) == 3
    kv.free(request)
    assert kv.pool.num_free_blocks == 8
    kv.check_invariants()


def test_prefix_hit_reuses_full_blocks_and_counts_tokens() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 11))  # 2 full blocks + 2 tokens
    _first, hit = admit(kv, "a", prompt)
    assert hit == NO_HIT
    second, hit = admit(kv, "b", [*prompt[:8], 50, 51, 52])
    # a's third block holds 2 tokens: not full, so not cached.
    assert hit == PrefixHit(tuple(kv.block_ids("a")[:2]), None, 8)
    assert tuple(kv.block_ids("b")[:2]) == hit.full_blocks and second.num_cached_tokens == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
    kv.check_invariants()


def test_prompt_leaving_the_cache_inside_a_block_reuses_its_shared_tokens_by_copy() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, "a", list(range(1, 13)))  # three full blocks, all cached
    a_blocks = kv.block_ids("a")
    request = make_request("b", [*range(1, 10), 60, 61, 62], cache_salt="t")
    hit = kv.find_prefix_hit(request)
    assert hit == PrefixHit(tuple(a_blocks[:2]), a_blocks[2], 9)
    copies = kv.allocate(request, 3, hit)
    table = kv.block_ids("b")
    assert table[:2] == a_blocks[:2] and table[2] not in a_blocks
    assert copies == [(a_blocks[2], table[2])] and request.num_computed_tokens == 9
    assert kv.prefix_cache_hits == 9
    kv.check_invariants()


def test_repeated_prompt_computes_only_its_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    first, _ = admit(kv, "a", list(range(1, 9)))  # exactly two full blocks
    kv.free(first)  # its cached blocks wait in the free queue
    request = make_request("b", list(range(1, 9)), cache_salt="t")
    hit = kv.find_prefix_hit(request)
    partial = hit.partial_block
    assert len(hit.full_blocks) == 1 and partial is not None
    assert hit.num_tokens == 7  # and 3 of the last block's 4 tokens
    assert kv.can_allocate(request, 1, hit)
    copies = kv.allocate(request, 1, hit)
    assert copies == [(partial, kv.block_ids("b")[1])]
    # The copy's source is not referenced: it stays cached and free until evicted.
    assert kv.pool.blocks[partial].ref_count == 0 or kv.block_ids("b")[1] == partial
    assert kv.pool.num_free_blocks == 16 - 2
    kv.check_invariants()


def test_different_salts_never_share_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 13))
    admit(kv, "a", prompt, salt=make_cache_salt("tenant-a", "model"))
    _request, hit = admit(kv, "b", prompt, salt=make_cache_salt("tenant-b", "model"))
    assert hit == NO_HIT
    _request, hit = admit(kv, "c", prompt, salt=make_cache_salt("tenant-a", "model2"))
    assert hit == NO_HIT
    _request, hit = admit(kv, "d", prompt, salt=make_cache_salt("tenant-a", "model"))
    assert len(hit.full_blocks) == 2 and hit.num_tokens == 11


def test_freed_cached_blocks_serve_later_hits_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(1, 10))
    first, _ = admit(kv, "a", prompt)
    kv.free(first)
    assert kv.pool.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2
    second, hit = admit(kv, "b", prompt)
    assert len(hit.full_blocks) == 2 and hit.partial_block is None
    kv.free(second)
    filler = make_request("filler", 16)
    kv.allocate(filler, 16)  # takes all 4 blocks: the cached ones are evicted
    assert kv.pool.num_cached_blocks == 0
    assert kv.find_prefix_hit(make_request("c", prompt, cache_salt="t")) == NO_HIT


def test_can_allocate_counts_revived_hits_as_no_longer_free() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    first, _ = admit(kv, "a", list(range(1, 10)))  # 3 blocks, 2 of them cached
    kv.free(first)
    request = make_request("b", list(range(1, 10)), cache_salt="t")
    hit = kv.find_prefix_hit(request)
    assert len(hit.full_blocks) == 2
    assert kv.can_allocate(request, 1, hit)  # 2 revived + 1 fresh == 3 free
    assert not kv.can_allocate(request, 5, hit)


def test_fork_shares_blocks_and_copies_the_partial_block_on_write() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    parent = make_request("p", 6)
    kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = make_request("c", parent.prompt_token_ids)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.block_ids("c") == kv.block_ids("p")
    kv.check_invariants()
    shared_full, shared_partial = kv.block_ids("p")
    copies = kv.allocate(child, 1)
    (src, dst), = copies
    assert src == shared_partial and dst not in kv.block_ids("p")
    assert kv.block_ids("c") == [shared_full, dst]
    assert kv.allocate(parent, 1) == []  # the parent now owns its partial block alone
    kv.free(parent)
    kv.free(child)
    assert kv.pool.num_free_blocks == 8
    kv.check_invariants()


def test_allocate_without_room_raises() -> None:
    kv = KVCacheManager(num_blocks=1, block_size=4)
    with pytest.raises(RuntimeError, match="not enough free blocks"):
        kv.allocate(make_request("r", 5), 5)


def test_can_ever_fit_compares_with_the_whole_pool() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.can_ever_fit(8) and not kv.can_ever_fit(9)
