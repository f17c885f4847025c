"""The result cache in Redis, shared by several gateway replicas: a hit on one is a hit on all.
``RedisResultCache`` has ``result_cache.ResultCache``'s get/put and stats; the keys are the same
(``result_cache.cache_key``: per tenant, on the prompt's token ids and the sampling settings).
Each value is its JSON under one key, set with an expiry of ``ttl_s``. Each tenant's entries are
bounded by count (``tenant_entries``) and bytes (``tenant_bytes``): a sorted set per tenant of its
keys by when each was stored, and a hash of their sizes, trimmed in the same Lua call that stores
(its own oldest entries go first, expired ones before them), so one tenant writing many entries
evicts only its own and never gives Redis' ``maxmemory`` policy a reason to evict another's (size
maxmemory for tenants x tenant_bytes). Every key of a tenant's entries carries its hash tag
(``cascade:cache:{tenant}:...``, the same tag as its quota buckets), so the store script, which
names value keys it was not passed, touches one Redis Cluster slot, and the gateway's request path
(``pipeline.state_redis``) looks an answer up in the same script call that admits it against the
tenant's quotas. (Entries written under the untagged keys of earlier versions are not read: they
expire with their ttl.)

Each replica also answers a hit it has just read from memory for up to ``near_s`` (never past the
entry's time to live in Redis): the near cache, which spares a round trip to Redis on the hits of
a tenant with neither quota nor budget to check (``pipeline.state_redis``). A cached answer is
deterministic (temperature 0 or a seed), so the copy a replica holds is the answer Redis holds.

A cache is an optimisation: when Redis fails a lookup or a store, the request runs as a miss
(logged) rather than failing."""

from __future__ import annotations

import json
import logging
import time
from collections import OrderedDict
from typing import Any

import redis

from cascade import wire
from cloud_tier.gateway.pipeline.result_cache import CacheStats, ResultCache
from cloud_tier.gateway.tenants.quotas_redis import connect

log = logging.getLogger(__name__)


# KEYS: the value's key, the tenant's sorted set (key -> stored at, ms), its hash (key -> bytes, and
# "" -> their total). ARGV: the key, the JSON, ttl ms, the tenant's bounds (entries, bytes), the prefix.
_PUT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl, most, most_bytes = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local function drop(member)
  redis.call('DEL', ARGV[6] .. member)
  redis.call('ZREM', KEYS[2], member)
  local size = tonumber(redis.call('HGET', KEYS[3], member) or '0')
  redis.call('HDEL', KEYS[3], member)
  redis.call('HINCRBY', KEYS[3], '', -size)
end
if redis.call('ZSCORE', KEYS[2], ARGV[1]) then drop(ARGV[1]) end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - ttl)) do drop(m) end
local size = string.len(ARGV[2])
if size > most_bytes then return 0 end
redis.call('SET', KEYS[1], ARGV[2], 'PX', ttl)
redis.call('ZADD', KEYS[2], now, ARGV[1])
redis.call('HSET', KEYS[3], ARGV[1], size)
local total = redis.call('HINCRBY', KEYS[3], '', size)
while redis.call('ZCARD', KEYS[2]) > most or total > most_bytes do
  drop(redis.call('ZRANGE', KEYS[2], 0, 0)[1])
  total = tonumber(redis.call('HGET', KEYS[3], ''))
end
redis.call('PEXPIRE', KEYS[2], ttl)
redis.call('PEXPIRE', KEYS[3], ttl)
return 1
"""


# the value under KEYS[1] and its milliseconds to live
_GET = "return {redis.call('GET', KEYS[1]), redis.call('PTTL', KEYS[1])}"


class RedisResultCache:
    put_script = _PUT
    get_script = _GET

    def __init__(self, url: str, max_bytes: int = 64 << 20, ttl_s: float = 600.0, prefix: str = "cascade:cache:",
                 tenant_entries: int = 1024, tenant_bytes: int = 16 << 20, near_s: float = 1.0,
                 near_entries: int = 1024):
        if max_bytes < 1 or ttl_s <= 0 or tenant_entries < 1 or tenant_bytes < 1:
            raise ValueError("max_bytes, ttl_s, tenant_entries and tenant_bytes must be > 0")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.tenant_entries, self.tenant_bytes = tenant_entries, tenant_bytes
        self._redis = connect(url)
        self._prefix = prefix
        self._put = self._redis.register_script(_PUT)
        self.stats = CacheStats()  # this replica's lookups (evictions are Redis': not counted here)
        # key -> (the JSON Redis gave, its value): a value Redis gives again as the same bytes is
        # not decoded again, and keeps what was rendered from it (pipeline.results.render_stored)
        self._decoded = ResultCache(1024, min(max_bytes, 16 << 20), ttl_s)
        self.near_s = near_s
        self.near_entries = near_entries
        self._near: OrderedDict[str, tuple[Any, float]] = OrderedDict()  # owner NUL key -> (value, until)

    def near(self, key: str, owner: str) -> Any | None:
        """The value this replica read from Redis less than ``near_s`` ago (and before its time to
        live there ran out), counted as a hit; None otherwise (nothing counted)."""
        got = self._near.get(f"{owner}\0{key}") if self.near_s > 0 else None
        if got is None or got[1] <= time.monotonic():
            return None
        self.stats.hits += 1
        return got[0]

    def _keep_near(self, key: str, owner: str, value: Any, ttl_ms) -> None:
        if self.near_s <= 0 or not isinstance(ttl_ms, int) or ttl_ms <= 0:
            return
        near_key = f"{owner}\0{key}"
        self._near[near_key] = (value, time.monotonic() + min(self.near_s, ttl_ms / 1000))
        self._near.move_to_end(near_key)
        while len(self._near) > self.near_entries:
            self._near.popitem(last=False)

    def value_key(self, key: str, owner: str) -> str:
        """The Redis key of ``owner``'s (the tenant's) entry ``key``."""
        return f"{self._prefix}{{{owner}}}:{key}"

    def get(self, key: str, owner: str = "") -> Any | None:
        """The value, or None if absent or expired."""
        try:
            raw = self._redis.get(self.value_key(key, owner))
        except redis.RedisError as e:
            log.warning("result cache lookup failed (a miss): %s", e)
            raw = None
        return self.decoded(key, raw)

    def decoded(self, key: str, raw: bytes | None, owner: str = "", ttl_ms: int | None = None) -> Any | None:
        """The value of what Redis gave for ``key`` (None: a miss), counted as a hit or a miss; kept
        in the near cache for what is left of ``ttl_ms`` (its time to live in Redis) up to ``near_s``."""
        if raw is None:
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        known = self._decoded.get(key)
        if known is not None and known[0] == raw:
            self._keep_near(key, owner, known[1], ttl_ms)
            return known[1]
        try:  # another replica wrote it: read as outside data
            value = wire.loads(raw, limit=self.max_bytes, int64=False)
        except wire.WireError as e:
            log.warning("result cache entry unreadable (a miss): %s", e)
            self.stats.hits -= 1
            self.stats.misses += 1
            return None
        self._decoded.put(key, (raw, value), len(raw))
        self._keep_near(key, owner, value, ttl_ms)
        return value

    def put(self, key: str, value: Any, size_bytes: int, owner: str = "") -> None:
        """Store the JSON-serialisable ``value`` for ``ttl_s`` (replacing any value under key) among
        ``owner``'s (the tenant's) entries, evicting its oldest past its bounds. A value whose JSON is
        larger than max_bytes or the tenant's bytes is not stored (and removes the old one)."""
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        call = self.put_call(key, value, size_bytes, owner)
        try:
            if call is None:
                self._redis.delete(self.value_key(key, owner))
            else:
                self._put(keys=call[0], args=call[1])
        except redis.RedisError as e:
            log.warning("result cache store failed: %s", e)

    def put_call(self, key: str, value: Any, size_bytes: int, owner: str) -> tuple[list, list] | None:
        """The store script's (keys, args) that ``put`` runs; None when the value is too large to
        store (its old one is deleted instead)."""
        self._near.pop(f"{owner}\0{key}", None)  # what this replica stores supersedes what it read
        payload = json.dumps(value, separators=(",", ":"))
        if max(size_bytes, len(payload)) > min(self.max_bytes, self.tenant_bytes):
            return None
        tenant = f"{self._prefix}{{{owner}}}:"
        return ([self.value_key(key, owner), tenant + "keys", tenant + "sizes"],
                [key, payload, max(1, int(self.ttl_s * 1000)), self.tenant_entries, self.tenant_bytes, tenant])

    def close(self) -> None:
        self._redis.close()
