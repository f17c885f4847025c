"""The sliding-window layers' own KV blocks (a second "KV cache group", as vLLM's hybrid
allocator has): Gemma 3's local layers only ever read the last ``window`` positions, so their
blocks that fell out of the window are freed every step, while the global layers keep theirs.

A request's table keeps one entry per logical block; a freed entry reads as block 0 (the null
block): every read of it is outside the window, masked, and the CPU kernel never reaches it.
No prefix caching here: a hit would need the window's KV before the hit, which is gone.
"""

from __future__ import annotations

from cloud_tier.engine.block_pool import BlockPool, KVBlock
from cloud_tier.engine.request import Request
from cloud_tier.engine_config import EngineConfig

NULL_BLOCK = 0


class WindowBlocks:
    def __init__(self, num_blocks: int, block_size: int, window: int):
        self.block_size = block_size
        self.window = window
        self.pool = BlockPool(num_blocks)
        self.tables: dict[str, list[KVBlock | None]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def max_blocks_per_request(self, max_chunk: int) -> int:
        """The most blocks one request can hold at once: its window and a chunk, across block borders."""
        return -(-(self.window - 1 + max_chunk) // self.block_size) + 1

    def first_needed_block(self, num_computed_tokens: int) -> int:
        """Blocks before this one hold positions no query from ``num_computed_tokens`` on can see
        (a query at p reads keys p - window + 1 .. p)."""
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    def free_outside_window(self, request: Request) -> None:
        table = self.tables.get(request.request_id, [])
        for i in range(min(self.first_needed_block(request.num_computed_tokens), len(table))):
            if table[i] is not None:
                self.pool.free_blocks([table[i]])
                table[i] = None

    def num_new_blocks(self, request: Request, num_tokens: int) -> int:
        """Blocks to add so the table covers ``num_tokens`` positions."""
        return max(0, -(-num_tokens // self.block_size) - len(self.tables.get(request.request_id, [])))

    def allocate(self, request: Request, num_tokens: int) -> None:
        """Cover ``num_tokens`` positions (the caller checked that the blocks are free)."""
        table = self.tables.setdefault(request.request_id, [])
        table.extend(self.pool.get_new_blocks(self.num_new_blocks(request, num_tokens)))

    def block_ids(self, request_id: str) -> list[int]:
        return [NULL_BLOCK if b is None else b.block_id for b in self.tables.get(request_id, ())]

    def free(self, request: Request) -> None:
        table = self.tables.pop(request.request_id, [])
        self.pool.free_blocks(reversed([b for b in table if b is not None]))

    def check_integrity(self) -> None:
        held: dict[int, int] = {}
        for table in self.tables.values():
            for b in table:
                if b is not None:
                    held[b.block_id] = held.get(b.block_id, 0) + 1
        for b in self.pool.blocks:
            assert b.ref_cnt == held.get(b.block_id, 0) <= 1, f"window {b}: held by {held.get(b.block_id, 0)}"
            assert (b.ref_cnt == 0) == (b.block_id in self.pool.free_queue), f"window {b}: free queue mismatch"


def window_group(config: EngineConfig, layer_windows: list[int | None],
                 per_block: int) -> tuple[WindowBlocks | None, int, int]:
    """With ``kv_window_blocks``: the sliding-window layers' own group, the bytes of a block of the
    other layers, and the window group's bytes; else (None, ``per_block``, 0)."""
    windows = {w for w in layer_windows if w is not None}
    if not config.kv_window_blocks or not windows:
        return None, per_block, 0
    if len(windows) > 1:
        raise ValueError(f"kv_window_blocks needs one sliding window for all local layers, got {sorted(windows)}")
    window = WindowBlocks(config.kv_window_blocks, config.block_size, windows.pop())
    need = window.max_blocks_per_request(config.long_prefill_token_threshold or config.max_num_batched_tokens)
    if config.kv_window_blocks < need:
        raise ValueError(f"kv_window_blocks {config.kv_window_blocks} cannot hold one request's window and step "
                         f"({need} blocks)")
    per_layer = per_block // len(layer_windows)
    num_local = len(layer_windows) - sum(w is None for w in layer_windows)
    return window, per_layer * (len(layer_windows) - num_local), per_layer * num_local * config.kv_window_blocks
