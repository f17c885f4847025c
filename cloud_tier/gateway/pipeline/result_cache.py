"""Exact-match cache of deterministic results, keyed per tenant on the prompt's token ids and the
sampling settings, bounded by count, bytes and age, and shared fairly: when it is full, the owner
(tenant) holding the most loses its least recently used entry, so no tenant's requests can evict
another's entries while holding less than it."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cloud_tier.request_builder import RequestPlan


def cache_key(tenant: str, model: str, endpoint: str, plan: RequestPlan) -> str | None:
    """sha256 of what the model is asked (the prompt's token ids, exactly as the engine gets them)
    and how it samples (every SamplingParams field), or None when the output is not
    deterministic: only temperature 0 or a seed qualifies. Keying on the token ids, not on the
    request's text, means two prompts share an entry only if the model sees the same tokens (the
    endpoint is in the key because it shapes the answer). The tenant is always in the key, so no
    tenant can read another's entry."""
    params = plan.params
    if not (params.temperature == 0 or params.seed is not None):
        return None
    settings = params.to_dict()
    for f in dataclasses.fields(params):
        if f.type in ("float", float):
            settings[f.name] = float(settings[f.name])  # 0 and 0.0 ask for the same thing
    canonical = json.dumps({"tenant": tenant, "model": model, "endpoint": endpoint,
                            "prompt_token_ids": plan.prompt_token_ids, "params": settings},
                           sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # entries dropped to stay under the bounds (not expiries)


@dataclass
class _Entry:
    value: Any
    size_bytes: int
    expires_at: float
    owner: str


@dataclass
class _Holding:
    """One owner's entries (least recently used first) and their bytes."""

    keys: OrderedDict = field(default_factory=OrderedDict)
    size_bytes: int = 0


class ResultCache:
    """LRU of results, bounded by max_entries and max_bytes; an entry lives ttl_s seconds. Past a
    bound, the owner with the most entries (or bytes, for the byte bound) loses its least recently
    used one: a single owner's cache is a plain LRU."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 << 20, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_entries < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("max_entries, max_bytes and ttl_s must be > 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: dict[str, _Entry] = {}
        self._owners: dict[str, _Holding] = {}
        self.total_bytes = 0
        self.stats = CacheStats()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: str) -> Any | None:
        """The value, or None if absent or expired (an expired entry is removed)."""
        entry = self._entries.get(key)
        if entry is not None and entry.expires_at <= self._clock():
            self._remove(key)
            entry = None
        if entry is None:
            self.stats.misses += 1
            return None
        self._owners[entry.owner].keys.move_to_end(key)
        self.stats.hits += 1
        return entry.value

    def put(self, key: str, value: Any, size_bytes: int, owner: str = "") -> None:
        """Store (replacing any entry under key), evicting entries to stay under both bounds: the
        least recently used of whichever owner holds the most. An entry bigger than max_bytes is
        not stored."""
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        if key in self._entries:
            self._remove(key)  # the new value supersedes the old one even if it is not stored
        if size_bytes > self.max_bytes:
            return
        self._entries[key] = _Entry(value, size_bytes, self._clock() + self.ttl_s, owner)
        holding = self._owners.setdefault(owner, _Holding())
        holding.keys[key] = None
        holding.size_bytes += size_bytes
        self.total_bytes += size_bytes
        while len(self._entries) > self.max_entries or self.total_bytes > self.max_bytes:
            by_bytes = len(self._entries) <= self.max_entries
            largest = max(self._owners.values(), key=lambda h: h.size_bytes if by_bytes else len(h.keys))
            self._remove(next(iter(largest.keys)))
            self.stats.evictions += 1

    def _remove(self, key: str) -> None:
        entry = self._entries.pop(key)
        self.total_bytes -= entry.size_bytes
        holding = self._owners[entry.owner]
        del holding.keys[key]
        holding.size_bytes -= entry.size_bytes
        if not holding.keys:
            del self._owners[entry.owner]
