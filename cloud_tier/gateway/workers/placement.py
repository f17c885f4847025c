"""Choosing workers: a prefill worker by prefix affinity against load, a decode worker by free KV
blocks (power of two choices), and the approximate prefix index that feeds the affinity."""

from __future__ import annotations

import math
import random
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import xxhash

_ROOT_HASH = 0  # parent hash of a prompt's first block
TEXT_BLOCK_CHARS = 64  # GIE's approximate prefix scorer: 64 characters ~ one 16-token vLLM block
TEXT_MAX_BLOCKS = 256


class NoWorkerError(LookupError):
    """No healthy worker to route to."""


@dataclass(frozen=True)
class RouterConfig:
    alpha: float = 1.0  # weight of prefill ms saved by a prefix hit
    beta: float = 1.0  # weight of the overload penalty ms
    prefill_ms_per_token: float = 1.0  # how long one prompt token takes to prefill (estimate)
    overload_percentile: float = 75.0  # workers whose load is above this percentile of all loads
    overload_min_tokens: int = 512  # ... and above this many pending prefill tokens are overloaded
    block_size: int = 16  # tokens per block in the prefix index
    index_blocks_per_worker: int = 8192  # LRU bound of the prefix index, per worker

    def __post_init__(self):
        if self.alpha < 0 or self.beta < 0 or self.prefill_ms_per_token < 0:
            raise ValueError("alpha, beta and prefill_ms_per_token must be >= 0")
        if not 0.0 <= self.overload_percentile <= 100.0:
            raise ValueError(f"overload_percentile must be in 0..100, got {self.overload_percentile}")
        if self.overload_min_tokens < 0:
            raise ValueError(f"overload_min_tokens must be >= 0, got {self.overload_min_tokens}")
        if self.block_size < 1 or self.index_blocks_per_worker < 1:
            raise ValueError("block_size and index_blocks_per_worker must be >= 1")


@dataclass(frozen=True)
class WorkerLoad:
    worker_id: str
    pending_prefill_tokens: int = 0  # prompt tokens queued/in flight on it (the gateway's count)
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # used + committed by the gateway
    queue_len: int = 0
    healthy: bool = True

    @property
    def kv_blocks_free(self) -> int:
        return self.kv_blocks_total - self.kv_blocks_used


@dataclass(frozen=True)
class PrefillChoice:
    worker_id: str
    hit_tokens: int  # the estimated cached prefix on the chosen worker (even if not counted)
    score: float
    reason: str  # "prefix" (won on affinity) | "load" (no useful hit / affinity dropped) | "only"


def percentile(values: Sequence[float], pct: float) -> float:
    """Linear-interpolation percentile (numpy's default method) of a non-empty sequence."""
    ordered = sorted(values)
    pos = (len(ordered) - 1) * pct / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def choose_prefill(workers: Sequence[WorkerLoad], hit_tokens: Mapping[str, int],
                   config: RouterConfig) -> PrefillChoice:
    """Score = alpha * prefill ms a prefix hit saves - beta * ms of the worker's queue ahead of us.
    An overloaded worker's hit counts as 0, so a hot prefix cannot pile everything onto one
    worker. Ties go to fewer pending tokens, then to the lower worker_id."""
    healthy = [w for w in workers if w.healthy]
    if not healthy:
        raise NoWorkerError("no healthy prefill worker")
    threshold = percentile([w.pending_prefill_tokens for w in healthy], config.overload_percentile)
    ms = config.prefill_ms_per_token

    def counted_hit(w: WorkerLoad) -> int:
        overloaded = (w.pending_prefill_tokens > threshold
                      and w.pending_prefill_tokens > config.overload_min_tokens)
        return 0 if overloaded else hit_tokens.get(w.worker_id, 0)

    def score(w: WorkerLoad) -> float:
        return config.alpha * counted_hit(w) * ms - config.beta * w.pending_prefill_tokens * ms

    best = min(healthy, key=lambda w: (-score(w), w.pending_prefill_tokens, w.worker_id))
    if len(healthy) == 1:
        reason = "only"
    else:
        reason = "prefix" if counted_hit(best) > 0 else "load"
    return PrefillChoice(best.worker_id, hit_tokens.get(best.worker_id, 0), score(best), reason)


def watermark_blocks(w: WorkerLoad, high_watermark: float) -> int:
    """The blocks of ``w`` under the high watermark."""
    # floor with slack: 0.29 * 100 is 28.999999999999996 in floats, and blocks are whole
    return math.floor(high_watermark * w.kv_blocks_total + 1e-9)


def _fits(w: WorkerLoad, need_blocks: int, high_watermark: float) -> bool:
    return w.healthy and w.kv_blocks_used + need_blocks <= watermark_blocks(w, high_watermark)


def choose_decode(workers: Sequence[WorkerLoad], need_blocks: int, high_watermark: float,
                  rng: random.Random) -> WorkerLoad | None:
    """Power of two choices among healthy workers that stay under the watermark with need_blocks
    more: the one of two random candidates with more free blocks. None if no worker fits now."""
    fitting = [w for w in workers if _fits(w, need_blocks, high_watermark)]
    if not fitting:
        return None
    candidates = fitting if len(fitting) == 1 else rng.sample(fitting, 2)
    return min(candidates, key=lambda w: (-w.kv_blocks_free, w.queue_len, w.worker_id))


def fits_ever(workers: Sequence[WorkerLoad], need_blocks: int, high_watermark: float) -> bool:
    """Whether any healthy worker could hold need_blocks when empty (else waiting is pointless)."""
    return any(w.healthy and need_blocks <= watermark_blocks(w, high_watermark) for w in workers)


class PrefixIndex:
    """Approximate radix tree of recent prompts' token blocks, per worker: chained block hashes
    (hash of (parent hash, block tokens)), each worker's set bounded LRU.

    A prompt's blocks are inserted and touched last-to-first, so a prefix is always more recent
    than its continuations and eviction trims leaves before the blocks they hang from."""

    def __init__(self, block_size: int = 16, max_blocks_per_worker: int = 8192):
        if block_size < 1 or max_blocks_per_worker < 1:
            raise ValueError("block_size and max_blocks_per_worker must be >= 1")
        self.block_size = block_size
        self.max_blocks_per_worker = max_blocks_per_worker
        self._blocks: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}  # per-worker bounds, where one is known

    def block_hashes(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the full blocks of token_ids (a trailing partial block is ignored)."""
        hashes: list[int] = []
        parent = _ROOT_HASH
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash((parent, tuple(token_ids[start:start + self.block_size])))
            hashes.append(parent)
        return hashes

    def insert(self, worker_id: str, token_ids: Sequence[int]) -> None:
        """Record that the worker now holds these blocks."""
        self.insert_hashes(worker_id, self.block_hashes(token_ids))

    def match(self, token_ids: Sequence[int]) -> dict[str, int]:
        """worker_id -> matched prefix length in tokens (consecutive leading full blocks held),
        for every worker with a hit. Matched entries are touched."""
        return {w: n * self.block_size for w, n in self.match_hashes(self.block_hashes(token_ids)).items()}

    def insert_hashes(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Record a prompt's chained block hashes (any block kind: token or character blocks)."""
        blocks = self._blocks.setdefault(worker_id, OrderedDict())
        for h in reversed(hashes):
            blocks[h] = None
            blocks.move_to_end(h)
        limit = self._capacity.get(worker_id, self.max_blocks_per_worker)
        while len(blocks) > limit:
            blocks.popitem(last=False)

    def match_hashes(self, hashes: Sequence[int]) -> dict[str, int]:
        """worker_id -> how many leading blocks of ``hashes`` it holds (only workers with a hit)."""
        hits: dict[str, int] = {}
        for worker_id, blocks in self._blocks.items():
            n = 0
            while n < len(hashes) and hashes[n] in blocks:
                n += 1
            for h in reversed(hashes[:n]):
                blocks.move_to_end(h)
            if n:
                hits[worker_id] = n
        return hits

    def set_capacity(self, worker_id: str, max_blocks: int) -> None:
        """Bound one worker's entries (e.g. by the blocks its KV cache holds)."""
        self._capacity[worker_id] = max(1, max_blocks)

    def remove_worker(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
        self._capacity.pop(worker_id, None)

    def num_blocks(self, worker_id: str) -> int:
        """How many blocks the index records for the worker."""
        return len(self._blocks.get(worker_id, ()))


def text_block_hashes(model: str, text: str, block_chars: int = TEXT_BLOCK_CHARS,
                      max_blocks: int = TEXT_MAX_BLOCKS) -> list[int]:
    """Chained hashes of a prompt's full ``block_chars``-byte blocks, for workers whose tokenizer
    the gateway does not have (the Gateway API Inference Extension's approximate prefix scorer):
    the chain is seeded by xxh64(model name), each block's hash is xxh64(block + the previous
    hash as 8 little-endian bytes); a trailing partial block and anything past ``max_blocks`` are
    ignored."""
    data = text.encode()[:block_chars * max_blocks]
    parent = xxhash.xxh64_intdigest(model.encode())
    hashes: list[int] = []
    for start in range(0, len(data) - block_chars + 1, block_chars):
        parent = xxhash.xxh64_intdigest(data[start:start + block_chars] + parent.to_bytes(8, "little"))
        hashes.append(parent)
    return hashes
