"""Per-tenant and per-key rate limits: token buckets for requests/s and tokens/min."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

_EPS = 1e-9  # float slack so that waiting exactly the returned time is enough


class TokenBucket:
    """capacity tokens, refilled at rate per second (continuous), starting full. clock injectable.
    The level may go negative after charge(): the debt is repaid by refill before anything else
    can be taken. The debt is at most one capacity, so no wait is ever longer than two full
    refills (a charge past it, a worker's usage that lied, is not carried over)."""

    def __init__(self, rate: float, capacity: float, clock: Callable[[], float] = time.monotonic):
        if rate <= 0 or capacity <= 0:
            raise ValueError(f"rate and capacity must be > 0, got {rate}, {capacity}")
        self.rate = rate
        self.capacity = capacity
        self._clock = clock
        self._level = capacity
        self._at = clock()

    @property
    def level(self) -> float:
        now = self._clock()
        self._level = min(self.capacity, self._level + (now - self._at) * self.rate)
        self._at = now
        return self._level

    def wait_for(self, amount: float) -> float:
        """Seconds until amount is available (0.0 if now; math.inf if amount > capacity).
        Takes nothing."""
        if amount > self.capacity:
            return math.inf
        short = amount - self.level
        return 0.0 if short <= _EPS else short / self.rate

    def try_take(self, amount: float) -> float:
        """0.0 if taken; else seconds until amount would be available (nothing taken)."""
        wait = self.wait_for(amount)
        if wait == 0.0:
            self._level -= amount
        return wait

    def give_back(self, amount: float) -> None:
        """Refund, capped at capacity."""
        self._level = min(self.capacity, self.level + amount)

    def charge(self, amount: float) -> None:
        """Take unconditionally (may go negative, down to -capacity)."""
        self._level = max(-self.capacity, self.level - amount)


@dataclass(frozen=True)
class Limits:
    rps: float = 0.0  # requests/s, 0 = unlimited; burst capacity = max(1, rps)
    tpm: float = 0.0  # tokens/min, 0 = unlimited; capacity = tpm, refill tpm/60 per s

    def __post_init__(self):
        if self.rps < 0 or self.tpm < 0:
            raise ValueError(f"rps and tpm must be >= 0, got {self.rps}, {self.tpm}")


@dataclass(frozen=True)
class QuotaDecision:
    allowed: bool
    retry_after_s: float = 0.0  # math.inf with reason "tpm_never": retrying cannot help
    reason: str = ""  # "" | "rps" | "tpm" | "tpm_never" (larger than the whole per-minute budget)
    scope: str = ""  # "tenant" | "key"


_ALLOWED = QuotaDecision(True)


class Quotas:
    """Per-tenant and per-key buckets. admit() checks every applicable bucket and takes from all
    or none. Buckets are created lazily per (scope, id, kind) and recreated (full) when the
    limits given for that id change; a limit of 0 has no bucket and never refuses."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        # (scope, id, kind) -> (rate, capacity, bucket)
        self._buckets: dict[tuple[str, str, str], tuple[float, float, TokenBucket]] = {}

    def _bucket(self, scope: str, ident: str, kind: str, rate: float,
                capacity: float) -> TokenBucket:
        key = (scope, ident, kind)
        entry = self._buckets.get(key)
        if entry is None or entry[:2] != (rate, capacity):
            entry = (rate, capacity, TokenBucket(rate, capacity, self._clock))
            self._buckets[key] = entry
        return entry[2]

    def _applicable(self, scope: str, ident: str, limits: Limits, tokens: int):
        if limits.rps > 0:
            yield scope, "rps", self._bucket(scope, ident, "rps", limits.rps, max(1.0, limits.rps)), 1
        if limits.tpm > 0:
            yield scope, "tpm", self._bucket(scope, ident, "tpm", limits.tpm / 60.0, limits.tpm), tokens

    def admit(self, tenant: str, key_id: str, tenant_limits: Limits, key_limits: Limits,
              predicted_tokens: int) -> QuotaDecision:
        """Take one request and predicted_tokens from every applicable bucket, or refuse with the
        longest wait among the buckets that refused (tpm_never wins: no wait is enough)."""
        if not (tenant_limits.rps or tenant_limits.tpm or key_limits.rps or key_limits.tpm):
            return _ALLOWED  # no bucket applies (most keys, on every cache hit)
        checks = [*self._applicable("tenant", tenant, tenant_limits, predicted_tokens),
                  *self._applicable("key", key_id, key_limits, predicted_tokens)]
        refusal: QuotaDecision | None = None
        for scope, kind, bucket, amount in checks:
            wait = bucket.wait_for(amount)
            if wait == 0.0 or (refusal is not None and wait <= refusal.retry_after_s):
                continue
            reason = "tpm_never" if math.isinf(wait) else kind
            refusal = QuotaDecision(False, wait, reason, scope)
        if refusal is not None:
            return refusal
        for _, _, bucket, amount in checks:
            bucket.charge(amount)
        return QuotaDecision(True)

    def reconcile(self, tenant: str, key_id: str, predicted_tokens: int,
                  actual_tokens: int) -> None:
        """Settle the tpm buckets once the real token count is known: refund predicted - actual,
        or charge the difference when actual > predicted."""
        diff = predicted_tokens - actual_tokens
        for key in (("tenant", tenant, "tpm"), ("key", key_id, "tpm")):
            entry = self._buckets.get(key)
            if entry is None:
                continue
            if diff > 0:
                entry[2].give_back(diff)
            elif diff < 0:
                entry[2].charge(-diff)
