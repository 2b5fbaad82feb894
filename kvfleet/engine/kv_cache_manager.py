"""`KVCacheManager`: which blocks each request holds, prefix-cache lookups, copy-on-write.

A request's block table is `block_ids(request_id)`: token position p lives in block
`table[p // block_size]` at slot `p % block_size`.

Prefix caching: block i of a request is identified by a hash chain
`h_i = sha256(h_{i-1} || tokens of block i)` over FULL blocks only, with
`h_{-1} = sha256(salt)`. The salt carries the cache scope (tenant scope, model hash,
adapter, template version), so two requests share a block only if they agree on all of those
and on every token before and in that block. SHA-256 rather than Python's `hash`: a collision
would serve one tenant's KV to another.

A prompt that leaves the cached chain inside a block (it diverges there, or it repeats a
cached prompt and must still compute its last token) reuses the tokens it shares with a
cached block after the last matching hash: a fresh block gets a copy of that block, the
request computes from the first differing token, and the stale slots after it are
overwritten before anything reads them (attention reads only computed positions).

Invariants:
- the sum over requests of how often a block appears in their tables equals its ref_count;
- only the block at position `num_computed_tokens // block_size` can be written by the next
  step, and it is never shared or hashed when written: `allocate` replaces a shared one by a
  private copy and returns the (src, dst) pair for the runner (copy-on-write after `fork`),
  and a partial prefix hit is always a copy;
- a full prompt hit still leaves the last prompt token to compute, because its logits are
  needed to sample the first output token.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

from kvfleet.engine.block_pool import BlockHash, BlockPool
from kvfleet.engine.request import Request


def make_cache_salt(tenant_scope: str, model_hash: str = "", adapter: str = "",
                    template_version: str = "") -> str:
    """The prefix-cache scope of a request; `tenant_scope` is a tenant, or a shared scope
    name for tenants whose quota allows cross-tenant caching."""
    return "\x1f".join((tenant_scope, model_hash, adapter, template_version))


def salt_hash(salt: str) -> BlockHash:
    return hashlib.sha256(b"kvfleet-prefix-v1\x00" + salt.encode()).digest()


def hash_block_tokens(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    digest = hashlib.sha256(parent)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


@dataclass(frozen=True, slots=True)
class PrefixHit:
    """Cached KV for a request's first `num_tokens` tokens: `full_blocks` in table order, then
    possibly `partial_block`, a cached block whose first `num_tokens % block_size` tokens are
    the request's next ones (copied into a block of the request's own)."""

    full_blocks: tuple[int, ...] = ()
    partial_block: int | None = None
    num_tokens: int = 0


NO_HIT = PrefixHit()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # chain over the request's full blocks
        self._num_indexed: dict[str, int] = {}  # leading table blocks already in the index
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    # -- sizing --------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` fits the whole pool when it runs alone."""
        return self.num_blocks_for(num_tokens) <= self.pool.num_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return self._tables.get(request_id, [])

    # -- prefix cache --------------------------------------------------------------------

    def _block_hashes(self, request: Request, num_full_blocks: int) -> list[BlockHash]:
        """The hash chain of the request's first `num_full_blocks` blocks (memoised)."""
        hashes = self._hashes.setdefault(request.request_id, [])
        tokens = request.all_token_ids
        size = self.block_size
        while len(hashes) < num_full_blocks:
            i = len(hashes)
            parent = hashes[-1] if hashes else salt_hash(request.cache_salt)
            hashes.append(hash_block_tokens(parent, tokens[i * size:(i + 1) * size]))
        return hashes

    def find_prefix_hit(self, request: Request) -> PrefixHit:
        """The longest cached prefix of this (not yet scheduled) request's tokens.

        A pure lookup: the query is counted by `allocate`, once the request is admitted."""
        if not self.enable_prefix_caching:
            return NO_HIT
        # Below num_tokens: the last token must be computed to sample from its logits.
        max_hit_tokens = request.num_tokens - 1
        size = self.block_size
        hashes = self._block_hashes(request, max_hit_tokens // size)
        full: list[int] = []
        for block_hash in hashes:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            full.append(block_id)
        start = len(full) * size
        parent = hashes[len(full) - 1] if full else salt_hash(request.cache_salt)
        partial, num_partial = self.pool.longest_partial_match(
            parent, request.all_token_ids[start:min(start + size, max_hit_tokens)])
        if not full and partial is None:
            return NO_HIT
        return PrefixHit(tuple(full), partial, start + num_partial)

    def cache_blocks(self, request: Request) -> None:
        """Index the request's full blocks whose KV is now computed."""
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(request.request_id)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(table))
        start = self._num_indexed.get(request.request_id, 0)
        if num_full <= start:
            return
        hashes = self._block_hashes(request, num_full)
        tokens, size = request.all_token_ids, self.block_size
        for i in range(start, num_full):
            parent = hashes[i - 1] if i else salt_hash(request.cache_salt)
            self.pool.cache_block(table[i], hashes[i], parent, tokens[i * size:(i + 1) * size])
        self._num_indexed[request.request_id] = num_full

    # -- allocation ----------------------------------------------------------------------

    def _plan(self, request: Request, num_new_tokens: int, hit: PrefixHit) -> tuple[int, bool]:
        """(fresh blocks needed, whether the block written first must be copied)."""
        table = self._tables.get(request.request_id, [])
        num_computed = request.num_computed_tokens + hit.num_tokens
        num_needed = self.num_blocks_for(num_computed + num_new_tokens)
        # A partial hit's block is one of the fresh ones: it receives the copy.
        num_fresh = max(0, num_needed - len(table) - len(hit.full_blocks))
        first = num_computed // self.block_size
        cow = first < len(table) and self.pool.blocks[table[first]].ref_count > 1
        return num_fresh + int(cow), cow

    def can_allocate(self, request: Request, num_new_tokens: int,
                     hit: PrefixHit = NO_HIT) -> bool:
        num_fresh, _cow = self._plan(request, num_new_tokens, hit)
        # Hits sitting in the free queue stop being free once we reference them.
        num_revived = sum(self.pool.blocks[b].ref_count == 0 for b in hit.full_blocks)
        return num_fresh + num_revived <= self.pool.num_free_blocks

    def allocate(self, request: Request, num_new_tokens: int,
                 hit: PrefixHit = NO_HIT) -> list[tuple[int, int]]:
        """Reserve KV for `num_new_tokens` more tokens after the computed ones; adopt the
        prefix `hit` first. Returns block copies (src, dst) that the runner must apply before
        this step's forward pass (copy-on-write, or a partial hit's block)."""
        if not self.can_allocate(request, num_new_tokens, hit):
            raise RuntimeError(f"request {request.request_id}: not enough free blocks; "
                               "call can_allocate first")
        num_fresh, cow = self._plan(request, num_new_tokens, hit)
        table = self._tables.setdefault(request.request_id, [])
        if not table and request.num_computed_tokens == 0 and self.enable_prefix_caching:
            # First allocation of a fresh or preempted request: that is one cache query.
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += hit.num_tokens
        if hit.num_tokens:
            if table:
                raise RuntimeError(f"request {request.request_id}: prefix hits can only "
                                   "start an empty block table")
            self.pool.touch(hit.full_blocks)
            table.extend(hit.full_blocks)
            request.num_computed_tokens += hit.num_tokens
            self._num_indexed[request.request_id] = len(hit.full_blocks)
        copies: list[tuple[int, int]] = []
        if cow:
            first = request.num_computed_tokens // self.block_size
            src = table[first]
            (dst,) = self.pool.allocate(1)
            self.pool.free([src])
            table[first] = dst
            copies.append((src, dst))
            num_fresh -= 1
        fresh = self.pool.allocate(num_fresh)
        if hit.partial_block is not None:
            # The source is not referenced: if a later allocation of this step evicts and
            # reuses it (even as `fresh[0]` itself), that happens after the runner's copies,
            # which run before the forward pass writes anything.
            copies.append((hit.partial_block, fresh[0]))
        table.extend(fresh)
        return copies

    def fork(self, parent: Request, child: Request) -> None:
        """Let `child` share all of `parent`'s blocks; later writes copy (see `allocate`)."""
        if child.request_id in self._tables:
            raise RuntimeError(f"request {child.request_id} already holds blocks")
        table = list(self._tables.get(parent.request_id, []))
        self.pool.touch(table)
        self._tables[child.request_id] = table
        self._hashes[child.request_id] = list(self._hashes.get(parent.request_id, []))
        self._num_indexed[child.request_id] = self._num_indexed.get(parent.request_id, 0)

    def free(self, request: Request) -> None:
        """Release the request's blocks. Freed in reverse so that, among cached blocks, the
        tail of a sequence (least likely shared) is evicted first."""
        table = self._tables.pop(request.request_id, [])
        self._hashes.pop(request.request_id, None)
        self._num_indexed.pop(request.request_id, None)
        self.pool.free(reversed(table))

    def check_invariants(self) -> None:
        self.pool.check_invariants()
        refs = [0] * self.pool.num_blocks
        for request_id, table in self._tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id} holds a block twice: {table}")
            for block_id in table:
                refs[block_id] += 1
        for block in self.pool.blocks:
            if refs[block.block_id] != block.ref_count:
                raise AssertionError(f"block {block.block_id}: ref_count {block.ref_count} "
                                     f"but held by {refs[block.block_id]} tables")
