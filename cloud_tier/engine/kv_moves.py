"""The KV copies a step needs before its forward: swap-outs and swap-ins of preempted requests,
and the second tier's saves (cached blocks evicted for reuse) and loads (its prefix hits).

All reads come before all writes: a block freed or evicted while scheduling may be reused in
the same step, and its old content must be copied out before anything lands in it. The runner's
``read_blocks`` / ``write_blocks`` are the only way in and out of the cache.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from cloud_tier.engine.block_pool import EvictedBlock
from cloud_tier.engine.kv_cache_manager import KVCacheManager
from cloud_tier.engine.kv_tier import TierStorage
from cloud_tier.engine.model_runner import ModelRunner
from cloud_tier.engine.scheduling.output import SchedulerOutput
from cloud_tier.engine.swap import SwapSpace


def measure_copy_s_per_byte(runner: ModelRunner, num_blocks: int, repeats: int = 3) -> float:
    """Seconds per byte of a swap round trip (read_blocks, then write_blocks of the same bytes)
    over a few blocks, measured once at start (the cache is still empty: nothing is changed)."""
    ids = list(range(min(4, num_blocks)))
    runner.write_blocks(ids, runner.read_blocks(ids))  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        payload = runner.read_blocks(ids)
        runner.write_blocks(ids, payload)
    return (time.perf_counter() - start) / (repeats * payload.nbytes)


class KVMover:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, swap: SwapSpace, tier_dir: Path):
        self.runner, self.kv, self.swap = runner, kv, swap
        self.tier_storage = None
        if kv.tier is not None:
            one = runner.read_blocks([0])
            self.block_shape, self.block_dtype = tuple(one.shape), one.dtype
            tier_dir.mkdir(parents=True, exist_ok=True)
            fd, name = tempfile.mkstemp(prefix="kv-tier-", suffix=".bin", dir=tier_dir)
            os.close(fd)
            self.tier_storage = TierStorage(Path(name), kv.tier.num_slots, one.nbytes)
            os.unlink(name)  # the mapping keeps it while this engine lives; no file outlives it

    def before_step(self, out: SchedulerOutput) -> None:
        """Apply the step's copies: reads (tier slots, evicted blocks, swap-outs), then writes."""
        evicted, loads = self.kv.take_tier_moves()
        loaded = [self.tier_storage.read(x.slot) for x in loads]  # before saves may reuse the slots
        self.save_evicted(evicted)
        for s in out.swap_out:
            self.swap.put(s.request_id, self.runner.read_blocks(list(s.block_ids)))
        for s in out.swap_in:
            self.runner.write_blocks(list(s.block_ids), self.swap.take(s.request_id))
        if loads:
            self.runner.write_blocks([x.block_id for x in loads], self._from_slots(loaded))
            self.kv.tier.stats.loaded_bytes += sum(a.nbytes for a in loaded)

    def save_evicted(self, evicted: list[EvictedBlock] | None = None) -> None:
        """Copy cached blocks evicted for reuse into the tier (before anything overwrites them)."""
        if evicted is None:
            evicted, loads = self.kv.take_tier_moves()
            assert not loads, "tier loads outside a step"
        slots = [(e, self.kv.tier.insert(e.block_hash, e.parent_hash, e.token_ids)) for e in evicted]
        slots = [(e, slot) for e, slot in slots if slot is not None]
        if not slots:
            return
        payload = self.runner.read_blocks([e.block_id for e, _ in slots])
        for i, (_, slot) in enumerate(slots):
            self.tier_storage.write(slot, payload[:, :, i].contiguous().view(-1).view(torch.uint8).numpy())
        self.kv.tier.stats.saved_bytes += payload.nbytes

    def _from_slots(self, loaded: list[np.ndarray]) -> torch.Tensor:
        """Slot bytes back into ``read_blocks``' layout (blocks on dimension 2)."""
        layers, two, _, *rest = self.block_shape
        flat = torch.from_numpy(np.stack(loaded)).view(self.block_dtype)
        return flat.view(len(loaded), layers, two, *rest).permute(1, 2, 0, 3, 4, 5).contiguous()
