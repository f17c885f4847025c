"""Spend caps: a budget per tenant and per key, in tokens and/or USD, per UTC calendar day or month
(LiteLLM's budgets). The budgets are settings of the key store (``KeyRecords.budget``, cached like
limits); what was spent is counted in Redis when the gateway has one, else in the key store's own
database, so every replica (and ``cascade cloud keys list``) sees the same totals.

``check`` runs before a request and ``charge`` after it ends, so the requests already in flight
when a budget runs out still finish and are charged: a budget may be overshot by what they use
(once per request, never by a request admitted after the counters show it spent)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cascade import errors
from cloud_tier.gateway.tenants.keys import Budget
from sync.sql_async import run_now

if TYPE_CHECKING:
    from cloud_tier.gateway.tenants.keys import ApiKey, KeyRecords

log = logging.getLogger(__name__)

ADJECTIVE = {"day": "daily", "month": "monthly"}
RETAIN_S = 86400.0  # a Redis counter outlives its period by this much (replicas' clocks differ a little)


class SpendCounters(Protocol):
    """Where spend is counted: the key store (``KeyRecords``) or Redis (``RedisSpend``)."""

    def add_spend(self, charges: Sequence[tuple[str, str, str, float, float, float]]) -> None:
        """Add each (scope, name, period id, tokens, usd, ttl_s) to its counters."""

    def spent(self, counters: Sequence[tuple[str, str, str]]) -> list[tuple[float, float]]:
        """(tokens, usd) spent per (scope, name, period id)."""


def period_of(period: str, now: float) -> tuple[str, float]:
    """The id of the UTC calendar ``period`` ("day" or "month") that ``now`` falls in ("2026-12-01",
    "2026-12") and the time it ends (when the budget resets)."""
    t = dt.datetime.fromtimestamp(now, dt.UTC)
    if period == "day":
        start = dt.datetime(t.year, t.month, t.day, tzinfo=dt.UTC)
        return start.date().isoformat(), (start + dt.timedelta(days=1)).timestamp()
    if period == "month":
        end = dt.datetime(t.year + t.month // 12, t.month % 12 + 1, 1, tzinfo=dt.UTC)
        return f"{t.year:04d}-{t.month:02d}", end.timestamp()
    raise ValueError(f"unknown budget period {period!r}")


def iso_utc(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass(frozen=True)
class Spend:
    """A tenant's or a key's budget and what it has spent in the current period."""

    scope: str  # "tenant" | "key"
    name: str  # the tenant, or the key_id
    budget: Budget
    period_id: str
    resets_at: float
    tokens: float
    usd: float

    @property
    def exceeded(self) -> bool:
        b = self.budget
        return bool((b.tokens and self.tokens >= b.tokens) or (b.usd and self.usd >= b.usd))

    def describe(self) -> str:
        caps = [f"{self.budget.tokens:g} tokens" if self.budget.tokens else "",
                f"${self.budget.usd:g}" if self.budget.usd else ""]
        return (f"{ADJECTIVE[self.budget.period]} budget of {' and '.join(c for c in caps if c)} "
                f"({self.tokens:g} tokens, ${self.usd:.6g} spent)")


class Budgets:
    def __init__(self, keys: KeyRecords, spend: SpendCounters, prices: dict[str, tuple[float, float]],
                 clock: Callable[[], float] = time.time):
        self.keys = keys
        self.spend = spend
        self.prices = prices
        self._clock = clock

    def status(self, tenant: str, key_id: str | None = None, active_only: bool = False,
               now: float | None = None) -> list[Spend]:
        """The tenant's budget and spend, then the key's (when ``key_id`` is given); with
        ``active_only`` only those with a cap (and nothing is read when none has one)."""
        now = self._clock() if now is None else now
        scopes = [("tenant", tenant), *((("key", key_id),) if key_id else ())]
        budgets = [(scope, name, self.keys.budget(scope, name)) for scope, name in scopes]
        if active_only:
            budgets = [b for b in budgets if b[2].active]
        if not budgets:
            return []
        periods = [period_of(b.period, now) for _, _, b in budgets]
        spent = self.spend.spent([(scope, name, pid) for (scope, name, _), (pid, _) in zip(budgets, periods,
                                                                                             strict=True)])
        return [Spend(scope, name, b, pid, resets, tokens, usd)
                for (scope, name, b), (pid, resets), (tokens, usd) in zip(budgets, periods, spent, strict=True)]

    def check(self, key: ApiKey) -> None:
        """Refuse (429 ``budget_exceeded``, Retry-After: until the reset) a request of a key whose
        own budget or whose tenant's budget is spent."""
        now = self._clock()
        for s in self.status(key.tenant, key.key_id, active_only=True, now=now):
            refuse_if_spent(s, now)

    # -- the request path: budgets read without blocking the loop, spend read and counted in the
    # same round trip as the quota (pipeline.state)

    async def due(self, key: ApiKey) -> list[Spend]:
        """The active budgets a request of ``key`` must fit (its tenant's, then its own), with
        nothing spent yet: ``spent_from`` fills in the counters' values."""
        now = self._clock()
        out = []
        for scope, name in (("tenant", key.tenant), ("key", key.key_id)):
            b = await self.keys.budget_async(scope, name)
            if b.active:
                pid, resets = period_of(b.period, now)
                out.append(Spend(scope, name, b, pid, resets, 0.0, 0.0))
        return out

    def refuse_spent(self, due: list[Spend], spent: list[tuple[float, float]]) -> None:
        """``check`` on what was read: 429 ``budget_exceeded`` when a budget of ``due`` is spent."""
        now = self._clock()
        for s, (tokens, usd) in zip(due, spent, strict=True):
            refuse_if_spent(dataclasses.replace(s, tokens=tokens, usd=usd), now)

    async def charges(self, key: ApiKey, model: str, prompt_tokens: int,
                      completion_tokens: int) -> list[tuple[str, str, str, float, float, float]]:
        """What ``charge`` adds to the counters for a finished request (none for no tokens)."""
        return await self._charges(key, model, prompt_tokens, completion_tokens, self.keys.budget_async)

    async def _charges(self, key: ApiKey, model: str, prompt_tokens: int, completion_tokens: int,
                       budget_of: Callable) -> list[tuple[str, str, str, float, float, float]]:
        tokens = prompt_tokens + completion_tokens
        if tokens <= 0:
            return []
        prompt_price, completion_price = self.prices.get(model) or self.prices.get("*", (0.0, 0.0))
        usd = (prompt_tokens * prompt_price + completion_tokens * completion_price) / 1e6
        now = self._clock()
        charges = []
        for scope, name in (("tenant", key.tenant), ("key", key.key_id)):
            period_id, resets = period_of((await budget_of(scope, name)).period, now)
            charges.append((scope, name, period_id, float(tokens), usd, resets - now + RETAIN_S))
        return charges

    def charge(self, key: ApiKey, model: str, prompt_tokens: int, completion_tokens: int) -> None:
        """Count a finished request's tokens and price against its tenant and its key, in the
        period of each one's budget (monthly where none is set, so listings show spend). A charge
        lost to an outage of the counters' store is logged, not raised: the answer was served."""

        async def budget_of(scope: str, name: str) -> Budget:
            return self.keys.budget(scope, name)

        charges = run_now(self._charges(key, model, prompt_tokens, completion_tokens, budget_of))
        if not charges:
            return
        try:
            self.spend.add_spend(charges)
        except Exception:
            log.exception("spend of key %s (tenant %s) not counted: %d tokens, $%.6g", key.key_id, key.tenant,
                          charges[0][3], charges[0][4])


def refuse_if_spent(s: Spend, now: float) -> None:
    if s.exceeded:
        raise errors.too_many_requests(
            f"The {s.scope} {s.name!r} has used up its {s.describe()}; it resets at {iso_utc(s.resets_at)}.",
            s.resets_at - now, "budget_exceeded")


def spent_of(values: Sequence) -> list[tuple[float, float]]:
    """(tokens, usd) per counter from MGET's reply over ``RedisSpend.counter_keys``."""
    floats = [float(v) if v is not None else 0.0 for v in values]
    return list(zip(floats[0::2], floats[1::2], strict=True))


class RedisSpend:
    """Spend counters in Redis: ``INCRBYFLOAT`` on one key per scope, period and unit, expiring a
    day after its period ends; one round trip per charge or read."""

    def __init__(self, url: str, prefix: str = "cascade:spend:"):
        from cloud_tier.gateway.tenants.quotas_redis import connect

        self._redis = connect(url)
        self._prefix = prefix

    def _key(self, scope: str, name: str, period_id: str, unit: str) -> str:
        return f"{self._prefix}{scope}:{name}:{period_id}:{unit}"

    def add_spend(self, charges: Sequence[tuple[str, str, str, float, float, float]]) -> None:
        pipe = self._redis.pipeline(transaction=False)
        self.queue_add(pipe, charges)
        pipe.execute()

    def spent(self, counters: Sequence[tuple[str, str, str]]) -> list[tuple[float, float]]:
        return spent_of(self._redis.mget(self.counter_keys(counters)))

    def counter_keys(self, counters: Sequence[tuple[str, str, str]]) -> list[str]:
        """The keys of each (scope, name, period id)'s counters: tokens, then usd."""
        return [self._key(scope, name, pid, unit) for scope, name, pid in counters for unit in ("tokens", "usd")]

    def queue_add(self, pipe, charges: Sequence[tuple[str, str, str, float, float, float]]) -> None:
        """``add_spend``'s commands, onto a pipeline."""
        for scope, name, period_id, tokens, usd, ttl_s in charges:
            for unit, amount in (("tokens", tokens), ("usd", usd)):
                key = self._key(scope, name, period_id, unit)
                pipe.incrbyfloat(key, amount)
                pipe.expire(key, max(1, int(ttl_s)))

    def close(self) -> None:
        self._redis.close()
