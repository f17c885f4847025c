"""What a request asks of the gateway's shared state, as the pipeline awaits it: at admission the
result cache, the quotas and the spend counters (``lookup``, then ``admit`` on a miss), at the end
the quota's true-up, the spend and the cached answer (``settle``). Two backends with the same
decisions: ``LocalState`` (the embedded default: quotas and cache in this process, spend in the key
store) and ``state_redis.RedisState`` (several replicas: each call ONE round trip to Redis).

A cache is an optimisation: a cache that fails is a miss. A quota that cannot be decided fails the
request (the error propagates), as a budget's spend that cannot be read does; spend that cannot be
counted and an answer that cannot be kept are logged, never raised: the answer was served."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from cloud_tier.gateway.tenants.quotas import Limits, QuotaDecision

log = logging.getLogger(__name__)

Counters = Sequence[tuple[str, str, str]]  # (scope, name, period id) per budget to read
Charges = Sequence[tuple[str, str, str, float, float, float]]  # budgets.SpendCounters.add_spend's


@dataclass(frozen=True)
class Quota:
    """Who asks: the tenant, the key, and the limits of each."""

    tenant: str
    key_id: str
    tenant_limits: Limits
    key_limits: Limits


@dataclass(frozen=True)
class Lookup:
    hit: Any | None  # the cached answer, or None (a miss: nothing was taken from the quota)
    decision: QuotaDecision | None  # on a hit, the quota's decision for it (one request, no tokens)
    spent: list[tuple[float, float]] = field(default_factory=list)  # (tokens, usd) per counter asked
    admitted: bool = False  # a miss admitted in the same call (``miss_tokens``): ``decision`` is its


@dataclass(frozen=True)
class Keep:
    """An answer to keep in the cache."""

    key: str
    value: Any
    size_bytes: int


class RequestState(Protocol):
    async def lookup(self, q: Quota, cache_key: str | None, counters: Counters,
                     miss_tokens: int | None = None) -> Lookup:
        """The cached answer under ``cache_key`` (None: no lookup, a miss), admitted against the
        quota when it is a hit, and the ``counters``' spend (read whatever the decision); with
        ``miss_tokens``, a miss admitted in the same call with that many tokens (``admitted``)."""

    async def admit(self, q: Quota, tokens: int, counters: Counters) -> tuple[QuotaDecision, list]:
        """One request and ``tokens`` taken from every applicable bucket or none, and the spend."""

    async def reconcile(self, q: Quota, predicted: int, actual: int) -> None:
        """The tpm buckets trued up: ``predicted - actual`` tokens back (or charged)."""

    async def settle(self, q: Quota, predicted: int, actual: int, charges: Charges, keep: Keep | None) -> None:
        """The end of a served request: reconcile, count its spend, keep its answer; each step
        taken whatever another one did (failures logged)."""

    async def aclose(self) -> None: ...


class LocalState:
    """``quotas.Quotas`` and ``result_cache.ResultCache`` in this process; spend in the key store
    (``KeyRecords``: SQLite, or PostgreSQL awaited through its pool)."""

    def __init__(self, quotas, cache, spend):
        self.quotas = quotas
        self.cache = cache
        self.spend = spend

    async def _spent(self, counters: Counters) -> list:
        return await self.spend.spent_async(counters) if counters else []

    async def lookup(self, q: Quota, cache_key: str | None, counters: Counters,
                     miss_tokens: int | None = None) -> Lookup:
        hit = self.cache.get(cache_key) if cache_key else None
        if hit is None and miss_tokens is not None:
            d = self.quotas.admit(q.tenant, q.key_id, q.tenant_limits, q.key_limits, miss_tokens)
            return Lookup(None, d, await self._spent(counters) if d.allowed else [], admitted=True)
        decision = (self.quotas.admit(q.tenant, q.key_id, q.tenant_limits, q.key_limits, 0)
                    if hit is not None else None)
        return Lookup(hit, decision, await self._spent(counters))

    async def admit(self, q: Quota, tokens: int, counters: Counters) -> tuple[QuotaDecision, list]:
        d = self.quotas.admit(q.tenant, q.key_id, q.tenant_limits, q.key_limits, tokens)
        return d, (await self._spent(counters) if d.allowed else [])

    async def reconcile(self, q: Quota, predicted: int, actual: int) -> None:
        self.quotas.reconcile(q.tenant, q.key_id, predicted, actual)

    async def settle(self, q: Quota, predicted: int, actual: int, charges: Charges, keep: Keep | None) -> None:
        try:
            self.quotas.reconcile(q.tenant, q.key_id, predicted, actual)
        except Exception:
            log.exception("the quota of key %s (tenant %s) was not trued up", q.key_id, q.tenant)
        if charges:
            try:
                await self.spend.add_spend_async(charges)
            except Exception:
                log.exception("spend of key %s (tenant %s) not counted: %d tokens, $%.6g", q.key_id, q.tenant,
                              charges[0][3], charges[0][4])
        if keep is not None:
            try:
                self.cache.put(keep.key, keep.value, keep.size_bytes, owner=q.tenant)
            except Exception:
                log.exception("an answer of tenant %s was not cached", q.tenant)

    async def aclose(self) -> None:
        pass
