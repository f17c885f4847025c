"""The result cache in Redis, shared by several gateway replicas: a hit on one is a hit on all.
``RedisResultCache`` has ``result_cache.ResultCache``'s get/put and stats; the keys are the same
(``result_cache.cache_key``: per tenant, on the prompt's token ids and the sampling settings).
Each value is its JSON under one key, set with an expiry of ``ttl_s``; Redis' own ``maxmemory``
policy (e.g. allkeys-lru) bounds the total, which ResultCache bounds itself in one process (there
fairly per tenant; here Redis' LRU is not per tenant: a tenant filling Redis evicts others' entries,
though never reads or replaces them, since every key holds its tenant).

A cache is an optimisation: when Redis fails a lookup or a store, the request runs as a miss
(logged) rather than failing."""

from __future__ import annotations

import json
import logging
from typing import Any

import redis

from cloud_tier.gateway.quotas_redis import connect
from cloud_tier.gateway.result_cache import CacheStats, ResultCache

log = logging.getLogger(__name__)


class RedisResultCache:
    def __init__(self, url: str, max_bytes: int = 64 << 20, ttl_s: float = 600.0, prefix: str = "cascade:cache:"):
        if max_bytes < 1 or ttl_s <= 0:
            raise ValueError("max_bytes and ttl_s must be > 0")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._redis = connect(url)
        self._prefix = prefix
        self.stats = CacheStats()  # this replica's lookups (evictions are Redis': not counted here)
        # key -> (the JSON Redis gave, its value): a value Redis gives again as the same bytes is
        # not decoded again, and keeps what was rendered from it (streams.render_stored)
        self._decoded = ResultCache(1024, min(max_bytes, 16 << 20), ttl_s)

    def get(self, key: str) -> Any | None:
        """The value, or None if absent or expired."""
        try:
            raw = self._redis.get(self._prefix + key)
        except redis.RedisError as e:
            log.warning("result cache lookup failed (a miss): %s", e)
            raw = None
        if raw is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        known = self._decoded.get(key)
        if known is not None and known[0] == raw:
            return known[1]
        value = json.loads(raw)
        self._decoded.put(key, (raw, value), len(raw))
        return value

    def put(self, key: str, value: Any, size_bytes: int, owner: str = "") -> None:
        """Store the JSON-serialisable ``value`` for ``ttl_s`` (replacing any value under key).
        A value whose JSON is larger than max_bytes is not stored (and removes the old one).
        ``owner`` is ResultCache's (unused: Redis evicts)."""
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        payload = json.dumps(value, separators=(",", ":"))
        try:
            if max(size_bytes, len(payload)) > self.max_bytes:
                self._redis.delete(self._prefix + key)
            else:
                self._redis.set(self._prefix + key, payload, px=max(1, int(self.ttl_s * 1000)))
        except redis.RedisError as e:
            log.warning("result cache store failed: %s", e)

    def close(self) -> None:
        self._redis.close()
