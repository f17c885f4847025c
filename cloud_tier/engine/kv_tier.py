"""A second KV tier for the prefix cache: full, hashed blocks evicted from the pool to make room
are copied here (a memory-mapped file) instead of being lost, keyed by their chained hash, and a
later prompt's hit chain continues into it: those blocks are loaded rather than recomputed.

``TierIndex`` is the bookkeeping (slots, LRU, verification of parent hash and tokens) used by the
KV cache manager, without torch; ``TierStorage`` holds the bytes, one fixed-size slot per block.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class TierStats:
    hits: int = 0  # blocks of admitted prompts loaded from the tier
    misses: int = 0  # full blocks of admitted prompts found neither in the pool nor in the tier
    saved_bytes: int = 0  # copied into the tier
    loaded_bytes: int = 0  # copied back out of it


@dataclass(frozen=True)
class TierEntry:
    slot: int
    parent_hash: int
    token_ids: tuple[int, ...]


class TierIndex:
    """Which block hash sits in which slot, least recently used first."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError("the KV tier needs room for at least one block")
        self.num_slots = num_slots
        self.entries: OrderedDict[int, TierEntry] = OrderedDict()
        self.stats = TierStats()

    def lookup(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """The slot holding this block, if its parent and tokens really match. A pure lookup."""
        entry = self.entries.get(block_hash)
        if entry is None or entry.parent_hash != parent_hash or entry.token_ids != token_ids:
            return None
        return entry.slot

    def touch(self, block_hash: int) -> None:
        self.entries.move_to_end(block_hash)

    def insert(self, block_hash: int, parent_hash: int, token_ids: tuple[int, ...]) -> int | None:
        """A slot to write this block into (the least recently used one once full), or None if the
        tier holds it already (then it only becomes the most recently used)."""
        if block_hash in self.entries:
            self.touch(block_hash)
            return None
        if len(self.entries) < self.num_slots:
            slot = len(self.entries)
        else:
            _, evicted = self.entries.popitem(last=False)
            slot = evicted.slot
        self.entries[block_hash] = TierEntry(slot, parent_hash, token_ids)
        return slot

    def clear(self) -> None:
        self.entries.clear()

    def check_integrity(self) -> None:
        slots = [e.slot for e in self.entries.values()]
        assert len(slots) == len(set(slots)) <= self.num_slots, "two blocks in one tier slot"
        assert all(0 <= s < self.num_slots for s in slots)


class TierStorage:
    """The tier's bytes: a file of ``num_slots`` slots of ``slot_bytes``, memory-mapped, so the
    tier can be larger than RAM and the OS pages it in and out."""

    def __init__(self, path: Path, num_slots: int, slot_bytes: int):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.slots = np.memmap(path, dtype=np.uint8, mode="w+", shape=(num_slots, slot_bytes))

    def write(self, slot: int, data: np.ndarray) -> None:
        self.slots[slot] = data

    def read(self, slot: int) -> np.ndarray:
        return np.array(self.slots[slot])  # a copy: the slot may be rewritten in the same step
