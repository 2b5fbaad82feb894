"""`BlockPool`: the fixed set of KV blocks, their reference counts and the prefix-cache index.

Invariants (checked by `check_invariants`, which the property tests call after every step):
- every block is either in use (`ref_count > 0`) or in the free queue (`ref_count == 0`),
  never both, never neither;
- `cached[h] == b` implies `blocks[b].block_hash == h`: a hash maps to at most one block;
- a cached block is also indexed under (its parent's hash, its first token) with its tokens, so
  a prompt that diverges inside a block can still reuse the tokens it shares with a cached
  one (`longest_partial_match`);
- a block's hash is set only once its tokens are all known and its KV has been written, and
  only a block that has no hash is ever written again (copy-on-write guards shared partial
  blocks, see `KVCacheManager`).

The free queue is an LRU: blocks freed with a hash go to the back (they may be hit again and
are evicted oldest-first), blocks freed without one go to the front (nothing can reuse them,
so they are handed out before any cached block is evicted).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BlockHash = bytes


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    block_hash: BlockHash | None = None
    # Set with the hash: the chain hash before this block, and the block's tokens.
    parent_hash: BlockHash | None = None
    token_ids: tuple[int, ...] = ()


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Keys are block ids; order is eviction order (front first). Values are unused.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # (parent hash, first token) -> cached blocks continuing that parent with that token.
        self._children: dict[tuple[BlockHash, int], set[int]] = {}

    # -- accounting ----------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (including cached ones, which get evicted)."""
        return len(self._free)

    @property
    def num_allocated_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks whose KV is indexed by hash (in use or free-but-reusable)."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return self.num_allocated_blocks / self.num_blocks

    # -- allocation ----------------------------------------------------------------------

    def allocate(self, num: int) -> list[int]:
        """Take `num` blocks from the front of the free queue; evict their cached hashes."""
        if num > len(self._free):
            raise RuntimeError(f"asked for {num} blocks with {len(self._free)} free; "
                               "callers must check num_free_blocks first")
        block_ids = []
        for _ in range(num):
            block_id, _unused = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._evict(block)
            block.ref_count = 1
            block_ids.append(block_id)
        return block_ids

    def touch(self, block_ids: Iterable[int]) -> None:
        """Take one more reference on blocks (a prefix-cache hit or a fork)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drop one reference per block; blocks reaching zero join the free queue."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.block_hash is None:
                    self._free.move_to_end(block_id, last=False)

    # -- prefix cache --------------------------------------------------------------------

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def cache_block(self, block_id: int, block_hash: BlockHash, parent_hash: BlockHash,
                    token_ids: Sequence[int]) -> None:
        """Index a full, computed block. If another block already holds this hash (two
        requests computed the same prefix concurrently), the first stays the canonical one."""
        block = self.blocks[block_id]
        if block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash, block.parent_hash = block_hash, parent_hash
        block.token_ids = tuple(token_ids)
        self._cached[block_hash] = block_id
        self._children.setdefault((parent_hash, block.token_ids[0]), set()).add(block_id)

    def longest_partial_match(self, parent_hash: BlockHash, token_ids: Sequence[int]
                              ) -> tuple[int | None, int]:
        """The cached block after `parent_hash` whose tokens start with the longest prefix of
        `token_ids`, and that prefix's length ((None, 0) if none shares the first token).

        Why: hashes only match whole blocks, so a prompt that leaves a cached one in the
        middle of a block would recompute up to block_size - 1 tokens the cache holds; a
        prompt that repeats a cached one would recompute its whole last block."""
        if not token_ids:
            return None, 0
        best, best_len = None, 0
        for block_id in self._children.get((parent_hash, token_ids[0]), ()):
            cached = self.blocks[block_id].token_ids
            n = 0
            for a, b in zip(cached, token_ids, strict=False):
                if a != b:
                    break
                n += 1
            if n > best_len:
                best, best_len = block_id, n
        return best, best_len

    def reset_prefix_cache(self) -> int:
        """Forget every cached hash (e.g. after new weights); returns how many were dropped."""
        dropped = len(self._cached)
        for block in self.blocks:
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()
        self._cached.clear()
        self._children.clear()
        return dropped

    def _evict(self, block: Block) -> None:
        if block.block_hash is not None:
            del self._cached[block.block_hash]
            assert block.parent_hash is not None
            key = (block.parent_hash, block.token_ids[0])
            siblings = self._children[key]
            siblings.discard(block.block_id)
            if not siblings:
                del self._children[key]
            block.block_hash, block.parent_hash, block.token_ids = None, None, ()

    def check_invariants(self) -> None:
        for block in self.blocks:
            in_free = block.block_id in self._free
            if block.ref_count < 0 or (block.ref_count == 0) != in_free:
                raise AssertionError(f"block {block.block_id}: ref_count={block.ref_count}, "
                                     f"in free queue={in_free}")
            if block.block_hash is not None and self._cached.get(block.block_hash) != \
                    block.block_id:
                raise AssertionError(f"block {block.block_id} has a hash the index lacks")
        if len(self._cached) != sum(b.block_hash is not None for b in self.blocks):
            raise AssertionError("prefix-cache index and block hashes disagree")
        indexed = {(parent, block_id) for (parent, _first), ids in self._children.items()
                   for block_id in ids}
        expected = {(b.parent_hash, b.block_id) for b in self.blocks if b.block_hash is not None}
        if indexed != expected:
            raise AssertionError("partial-match index and cached blocks disagree")
