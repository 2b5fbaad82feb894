from __future__ import annotations

import pytest
from engine_fakes import make_request

from kvfleet.engine.kv_cache_manager import KVCacheManager, make_cache_salt
from kvfleet.engine.request import Request


def admit(kv: KVCacheManager, request_id: str, prompt: list[int],
          salt: str = "t") -> tuple[Request, list[int]]:
    """Admit a fresh request through the prefix cache, compute its prompt, index it."""
    request = make_request(request_id, prompt, cache_salt=salt)
    hits = kv.get_computed_blocks(request)
    num_hit_tokens = len(hits) * kv.block_size
    kv.allocate(request, request.num_tokens - num_hit_tokens, hits)
    request.num_computed_tokens = request.num_tokens
    kv.cache_blocks(request)
    return request, hits


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
    _first, hits = admit(kv, "a", prompt)
    assert hits == []
    second, hits = admit(kv, "b", [*prompt[:8], 50, 51, 52])
    assert hits == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[:2] == hits and second.num_cached_tokens == 0
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (10 + 11, 8)
    kv.check_invariants()


def test_full_prompt_hit_still_computes_the_last_token() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    admit(kv, "a", list(range(1, 9)))  # exactly two full blocks
    request = make_request("b", list(range(1, 9)), cache_salt="t")
    hits = kv.get_computed_blocks(request)
    assert len(hits) == 1  # the second block holds the last token: recomputed


def test_different_salts_never_share_blocks() -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4)
    prompt = list(range(1, 13))
    admit(kv, "a", prompt, salt=make_cache_salt("tenant-a", "model"))
    _request, hits = admit(kv, "b", prompt, salt=make_cache_salt("tenant-b", "model"))
    assert hits == []
    _request, hits = admit(kv, "c", prompt, salt=make_cache_salt("tenant-a", "model2"))
    assert hits == []
    _request, hits = admit(kv, "d", prompt, salt=make_cache_salt("tenant-a", "model"))
    assert len(hits) == 2


def test_freed_cached_blocks_serve_later_hits_until_evicted() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(1, 10))
    first, _ = admit(kv, "a", prompt)
    kv.free(first)
    assert kv.pool.num_free_blocks == 4 and kv.pool.num_cached_blocks == 2
    second, hits = admit(kv, "b", prompt)
    assert len(hits) == 2
    kv.free(second)
    filler = make_request("filler", 16)
    kv.allocate(filler, 16)  # takes all 4 blocks: the cached ones are evicted
    assert kv.pool.num_cached_blocks == 0
    assert kv.get_computed_blocks(make_request("c", prompt, cache_salt="t")) == []


def test_can_allocate_counts_revived_hits_as_no_longer_free() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    first, _ = admit(kv, "a", list(range(1, 10)))  # 3 blocks, 2 of them cached
    kv.free(first)
    request = make_request("b", list(range(1, 10)), cache_salt="t")
    hits = kv.get_computed_blocks(request)
    assert len(hits) == 2
    assert kv.can_allocate(request, 1, hits)  # 2 revived + 1 fresh == 3 free
    assert not kv.can_allocate(request, 5, hits)


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
