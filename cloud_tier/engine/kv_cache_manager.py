"""Which KV blocks each request holds, prefix reuse through chained block hashes, and the
integrity check the tests run after every step."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from cloud_tier.engine.block_pool import BlockPool, EvictedBlock, KVBlock
from cloud_tier.engine.kv_tier import TierIndex
from cloud_tier.engine.request import Request
from cloud_tier.engine.window_kv import WindowBlocks


@dataclass(frozen=True)
class KVCacheBlocks:
    """A value object handed between the scheduler and the KV cache manager."""

    blocks: tuple[KVBlock, ...] = ()
    tier_hashes: tuple[int, ...] = ()  # the hit chain's continuation in the second tier, to load

    def get_block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of which served from the cache

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0

    def record(self, num_tokens: int, num_hit: int) -> None:
        """One request admitted: its prompt's tokens looked up, ``num_hit`` of them found."""
        self.queries += num_tokens
        self.hits += num_hit


def model_salt(model_identity: str) -> int:
    """The root of every hash chain: KV computed by another model or version never matches."""
    return int.from_bytes(hashlib.sha256(model_identity.encode()).digest()[:8], "little")


@dataclass(frozen=True)
class TierLoad:
    block_id: int  # a newly allocated block ...
    slot: int  # ... that gets this tier slot's content before the step


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 model_identity: str = "", tier_blocks: int = 0, window: WindowBlocks | None = None):
        if block_size < 1:
            raise ValueError("block_size must be >= 1")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.salt = model_salt(model_identity)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.stats = PrefixCacheStats()
        # the second tier (``tier_blocks`` > 0, with prefix caching): evicted cached blocks go there
        self.tier = TierIndex(tier_blocks) if tier_blocks and enable_prefix_caching else None
        self.pool.record_evictions = self.tier is not None
        self.tier_loads: list[TierLoad] = []
        # the sliding-window layers' own blocks, freed as they leave the window (then no prefix caching)
        self.window = window
        if window is not None and enable_prefix_caching:
            raise ValueError("a separate sliding-window KV group does not work with prefix caching")

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_window_block_ids(self, request_id: str) -> list[int]:
        """The sliding-window layers' block table (freed blocks read as the null block)."""
        return self.window.block_ids(request_id)

    # -- prefix cache --------------------------------------------------------------------

    def _block_hashes(self, request: Request) -> list[int]:
        """Extend ``request.block_hashes`` over its full blocks (parent hash, then tokens)."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[i - 1] if i else self.salt
            hashes.append(hash((parent, tuple(request.token_ids[i * bs:(i + 1) * bs]))))
        return hashes

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """The longest cached prefix of the request's tokens, in whole blocks, and its length.
        At least one token is always left to compute, since the last one gives the logits. A pure
        lookup: the caller records in ``stats`` what it admits."""
        if not self.enable_prefix_caching:
            return KVCacheBlocks(), 0
        bs = self.block_size
        hashes = self._block_hashes(request)
        hits: list[KVBlock] = []
        tier_hits: list[int] = []
        parent = self.salt
        for i in range((request.num_tokens - 1) // bs):
            tokens = tuple(request.token_ids[i * bs:(i + 1) * bs])
            block = None if tier_hits else self.pool.lookup(hashes[i], parent, tokens)
            if block is not None:
                hits.append(block)
            elif self.tier is not None and self.tier.lookup(hashes[i], parent, tokens) is not None:
                tier_hits.append(hashes[i])
            else:
                break
            parent = hashes[i]
        return KVCacheBlocks(tuple(hits), tuple(tier_hits)), (len(hits) + len(tier_hits)) * bs

    # -- allocation ----------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: KVCacheBlocks | None = None, reserve: int = 0) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens of ``request`` (after the prefix-cache hits
        in ``new_computed_blocks``, when it is first scheduled), leaving ``reserve`` blocks free
        (others' reservations). Returns the newly allocated blocks, or None (and changes nothing
        but freeing sliding-window blocks no query reads again) if they do not fit."""
        held = self.req_blocks.get(request.request_id, [])
        computed = new_computed_blocks.blocks if new_computed_blocks else ()
        from_tier = new_computed_blocks.tier_hashes if new_computed_blocks is not None else ()
        num_computed = request.num_computed_tokens + (len(computed) + len(from_tier)) * self.block_size
        total = num_computed + num_new_tokens
        # tier hits are new blocks too: the first ones allocated, loaded before the step
        num_new_blocks = max(0, self.blocks_for_tokens(total) - len(held) - len(computed))
        # hits that sit in the free queue stop being allocatable once we take them
        num_free_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if self.window is not None:
            self.window.free_outside_window(request)  # whatever happens next, no query reads them again
            if self.window.num_new_blocks(request, total) > self.window.num_free_blocks:
                return None
        if num_new_blocks and num_new_blocks > self.pool.num_free - num_free_hits - reserve:
            return None
        if self.window is not None:
            self.window.allocate(request, total)
        blocks = self.req_blocks.setdefault(request.request_id, [])
        self.pool.touch(computed)
        blocks.extend(computed)
        new = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new)
        if new_computed_blocks is not None:
            self._load_from_tier(request, len(computed), new[:len(from_tier)], from_tier)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens))
        return KVCacheBlocks(tuple(new))

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        """Register the blocks that are full once this step has run, so later requests reuse
        them (the step writes a layer's K/V before any attention reads it)."""
        bs = self.block_size
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = num_tokens // bs
        if end <= start:
            return
        hashes = self._block_hashes(request)
        for i in range(start, end):
            parent = hashes[i - 1] if i else self.salt
            self.pool.cache(blocks[i], hashes[i], parent, tuple(request.token_ids[i * bs:(i + 1) * bs]))
        self._num_cached_blocks[request.request_id] = end

    def _load_from_tier(self, request: Request, num_pool_hits: int, blocks: list[KVBlock],
                        tier_hashes: tuple[int, ...]) -> None:
        """Note the loads of a newly admitted request's tier hits and count its tier hits and misses."""
        tier = self.tier
        if tier is None:
            return
        for block, h in zip(blocks, tier_hashes, strict=True):
            tier.touch(h)
            self.tier_loads.append(TierLoad(block.block_id, tier.entries[h].slot))
        tier.stats.hits += len(tier_hashes)
        tier.stats.misses += max(0, (request.num_tokens - 1) // self.block_size - num_pool_hits
                                 - len(tier_hashes))

    def take_tier_moves(self) -> tuple[list[EvictedBlock], list[TierLoad]]:
        """The blocks to copy into the tier and those to load from it, both before the next step
        runs (copies out first: a block evicted and reused in one step is saved before it is
        loaded or computed over)."""
        evicted, loads = self.pool.evicted, self.tier_loads
        self.pool.evicted, self.tier_loads = [], []
        return evicted, loads

    def truncate(self, request: Request, num_tokens: int) -> None:
        """Free the blocks of ``request`` past its first ``num_tokens`` tokens (those of proposed
        tokens it rejected). They were never registered in the prefix cache (only blocks full of
        known tokens are), so none is; they go first in the eviction order."""
        blocks = self.req_blocks.get(request.request_id)
        keep = self.blocks_for_tokens(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        tail = blocks[keep:]
        del blocks[keep:]
        assert self._num_cached_blocks.get(request.request_id, 0) <= keep, "a proposed token's block was cached"
        self.pool.free_blocks(tail)
        self.pool.uncache(b for b in tail if b.ref_cnt == 0)
        for b in tail:  # to the head of the free queue: nothing in them is worth keeping
            if b.ref_cnt == 0:
                self.pool.free_queue.move_to_end(b.block_id, last=False)

    def free_preempted(self, request: Request) -> None:
        """Free a preempted request's blocks: those past its computed tokens were allocated for a
        step that will not run for it, so they leave the prefix cache unless another request
        holds them (their KV is never written)."""
        blocks = self.req_blocks.get(request.request_id, [])
        unwritten = blocks[self.blocks_for_tokens(request.num_computed_tokens):]
        self.free(request)
        self.pool.uncache(b for b in unwritten if b.ref_cnt == 0)

    def free(self, request: Request) -> None:
        """Return a request's blocks; its tail goes first in the eviction order, since a prefix
        is more likely to be shared than a suffix."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))
        if self.window is not None:
            self.window.free(request)

    def discard(self, request: Request) -> None:
        """Free the blocks of a request whose KV may never have been written (its step or its
        adoption failed): those no other request holds also leave the prefix cache, so no later
        prompt reuses them. Others holding one were in the same failed step and are discarded too."""
        blocks = self.req_blocks.get(request.request_id, [])
        self.free(request)
        self.pool.uncache(b for b in blocks if b.ref_cnt == 0)

    def reset_prefix_cache(self) -> None:
        self.pool.reset_prefix_cache()
        if self.tier is not None:
            self.tier.clear()

    # -- invariants ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """free + in use == total; every ref count equals the block tables that hold the block;
        the free queue holds exactly the blocks with no reference; the hash index is consistent."""
        pool = self.pool
        held: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                held[b.block_id] = held.get(b.block_id, 0) + 1
        in_use = [b for b in pool.blocks if b.ref_cnt > 0]
        assert len(in_use) + pool.num_free == pool.num_blocks, (len(in_use), pool.num_free, pool.num_blocks)
        for b in pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0), f"{b}: held by {held.get(b.block_id, 0)} tables"
            assert (b.ref_cnt == 0) == (b.block_id in pool.free_queue), f"{b}: free queue mismatch"
        for h, b in pool.cached.items():
            assert b.block_hash == h, f"{b}: cached under a stale hash"
        cached_free = sum(1 for b in pool.free_queue.values() if b.block_hash is not None)
        assert cached_free <= len(pool.cached)
        if self.tier is not None:
            self.tier.check_integrity()
        if self.window is not None:
            self.window.check_integrity()
