"""Exact-match cache of deterministic results, keyed per tenant, bounded by count, bytes and age."""

from __future__ import annotations

import hashlib
import json
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

# Fields that do not change what the model generates. Every other field is part of the key, so a
# field we do not know about (tools, response_format, logit_bias, ...) can only cost a miss, never
# serve a result computed for a different request.
IGNORED_FIELDS = frozenset({"stream", "stream_options", "user", "cascade"})
FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "presence_penalty",
                          "frequency_penalty", "repetition_penalty"})


class _NotCacheable(Exception):
    pass


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content.strip()
    if isinstance(content, list):
        if not all(isinstance(p, Mapping) and p.get("type") == "text" for p in content):
            raise _NotCacheable  # an image or audio part: its bytes are not in the key
        return "".join(str(p.get("text", "")) for p in content).strip()
    raise _NotCacheable


def _normalize(field: str, value: Any) -> Any:
    if field == "messages":
        if not isinstance(value, list) or not all(isinstance(m, Mapping) for m in value):
            raise _NotCacheable
        # role and content normalized; name, tool_calls, tool_call_id, ... kept as given
        return [{**m, "content": _content_text(m.get("content"))} for m in value]
    if field == "stop":
        return sorted([value] if isinstance(value, str) else value)
    if field in FLOAT_FIELDS and _is_number(value):
        return float(value)  # 0 and 0.0 ask for the same thing
    return value


def cache_key(tenant: str, model: str, endpoint: str, body: Mapping) -> str | None:
    """sha256 of the request's canonical form, or None when its output is not deterministic:
    only temperature == 0 or an int seed qualifies (an absent temperature means OpenAI's 1).
    The tenant is always in the key, so no tenant can read another's entry."""
    temperature, seed = body.get("temperature"), body.get("seed")
    deterministic = ((_is_number(temperature) and temperature == 0)
                     or (isinstance(seed, int) and not isinstance(seed, bool)))
    if not deterministic:
        return None
    try:
        fields = {k: _normalize(k, v) for k, v in body.items()
                  if k not in IGNORED_FIELDS and k != "model" and v is not None
                  and not (k == "stop" and v == [])}
        canonical = json.dumps({"tenant": tenant, "model": model, "endpoint": endpoint,
                                "body": fields}, sort_keys=True, separators=(",", ":"),
                               ensure_ascii=False, allow_nan=False)
    except (_NotCacheable, TypeError, ValueError):
        return None  # a shape we cannot canonicalize safely is simply not cached
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


class ResultCache:
    """LRU of results, bounded by max_entries and max_bytes; an entry lives ttl_s seconds."""

    def __init__(self, max_entries: int = 4096, max_bytes: int = 64 << 20, ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic):
        if max_entries < 1 or max_bytes < 1 or ttl_s <= 0:
            raise ValueError("max_entries, max_bytes and ttl_s must be > 0")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()
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
        self._entries.move_to_end(key)
        self.stats.hits += 1
        return entry.value

    def put(self, key: str, value: Any, size_bytes: int) -> None:
        """Store (replacing any entry under key), evicting least recently used entries to stay
        under both bounds. An entry bigger than max_bytes is not stored."""
        if size_bytes < 0:
            raise ValueError(f"size_bytes must be >= 0, got {size_bytes}")
        if key in self._entries:
            self._remove(key)  # the new value supersedes the old one even if it is not stored
        if size_bytes > self.max_bytes:
            return
        self._entries[key] = _Entry(value, size_bytes, self._clock() + self.ttl_s)
        self.total_bytes += size_bytes
        while len(self._entries) > self.max_entries or self.total_bytes > self.max_bytes:
            self._remove(next(iter(self._entries)))
            self.stats.evictions += 1

    def _remove(self, key: str) -> None:
        self.total_bytes -= self._entries.pop(key).size_bytes
