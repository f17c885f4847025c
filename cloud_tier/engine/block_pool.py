"""KV cache blocks: reference counts, the free queue (LRU, evicted from the head) and the index
of cached full blocks by chained hash."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block holds a full, hashed block of tokens that a later request may reuse.
    block_hash: int | None = None
    parent_hash: int | None = None
    token_ids: tuple[int, ...] | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


@dataclass(frozen=True)
class EvictedBlock:
    """A cached block taken for reuse: what its content was, to save it elsewhere first."""

    block_id: int
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


class BlockPool:
    """Owns every block. A block is in use (ref_cnt > 0) or in the free queue; a free block may
    still be cached (hashed) until it is evicted to serve a new allocation."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}
        self.num_evictions = 0
        # With a second KV tier: the cached blocks evicted to serve allocations, for the engine to
        # copy out before the step that overwrites them runs.
        self.record_evictions = False
        self.evicted: list[EvictedBlock] = []

    @property
    def num_free(self) -> int:
        return len(self.free_queue)

    def get_new_blocks(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the head of the free queue, evicting cached ones."""
        if n > len(self.free_queue):
            raise ValueError(f"cannot allocate {n} blocks, {len(self.free_queue)} free")
        out = []
        for _ in range(n):
            _, block = self.free_queue.popitem(last=False)
            if self.record_evictions and block.block_hash is not None and self.cached.get(block.block_hash) is block:
                self.evicted.append(EvictedBlock(block.block_id, block.block_hash, block.parent_hash, block.token_ids))
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on blocks found in the prefix cache (removing free ones from the queue)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self.free_queue[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, ordered: Iterable[KVBlock]) -> None:
        """Drop a reference on each block; blocks that reach zero join the queue's tail in the
        given order (so the first given is evicted first)."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt < 0:
                raise AssertionError(f"{block} freed more often than taken")
            if block.ref_cnt == 0:
                self.free_queue[block.block_id] = block

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> KVBlock | None:
        """The cached block for this hash, if its parent and tokens really match (a hash hit is
        only a candidate)."""
        block = self.cached.get(block_hash)
        if block is None or block.parent_hash != parent_hash or block.token_ids != token_ids:
            return None
        return block

    def cache(self, block: KVBlock, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> None:
        if block.block_hash is not None or block_hash in self.cached:
            return  # already cached, or the same content is cached in another block: keep that one
        block.block_hash, block.parent_hash, block.token_ids = block_hash, parent_hash, token_ids
        self.cached[block_hash] = block

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Drop these blocks from the prefix cache (they stay where they are, free or in use)."""
        for block in blocks:
            self._evict(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self.cached.values()):
            self._evict(block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
                self.num_evictions += 1
            block.block_hash = block.parent_hash = block.token_ids = None
