"""The gateway's state, chosen by ``[gateway] db`` and ``[gateway] redis``: on one machine, keys,
budgets and idempotency records in SQLite files and quotas and the result cache in this process
(the embedded default); for several replicas, keys, budgets and idempotency in PostgreSQL (a
``postgresql://`` DSN) and quotas, the cache and spend counters in Redis (LiteLLM's split). Spend
is counted in Redis when there is one, else in the key store's database.

The request path reaches them through ``Stores.state`` (``pipeline.state``: the cache, the quotas
and the spend, one Redis round trip per step when on Redis) and the keys' and idempotency
records' awaited methods (PostgreSQL's async pool); close them with ``aclose()``."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cascade.config import cascade_home
from cloud_tier.config import CloudConfig, parse_model_prices
from cloud_tier.gateway.pipeline.result_cache import ResultCache
from cloud_tier.gateway.pipeline.state import LocalState, RequestState
from cloud_tier.gateway.tenants.budgets import Budgets, SpendCounters
from cloud_tier.gateway.tenants.keys import KeyRecords
from cloud_tier.gateway.tenants.keys_sqlite import KeyStore
from cloud_tier.gateway.tenants.quotas import Quotas
from sync.idempotency import IdempotencyRecords, IdempotencyStore

POSTGRES_PREFIXES = ("postgresql://", "postgres://")


def is_postgres(db: str) -> bool:
    return db.startswith(POSTGRES_PREFIXES)


def sqlite_path(db: str) -> Path:
    """The SQLite file ``db`` names ("": $CASCADE_HOME/cloud/gateway.db), its folder created."""
    path = Path(db) if db else cascade_home() / "cloud" / "gateway.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def batch_db_path(g) -> Path:
    """The Batch API's SQLite file: ``[gateway] batch_db``, else batches.db beside the key store's
    file (under $CASCADE_HOME/cloud when the keys are in PostgreSQL)."""
    if g.batch_db:
        return sqlite_path(g.batch_db)
    return sqlite_path("" if is_postgres(g.db) else g.db).with_name("batches.db")


def open_key_store(db: str) -> KeyRecords:
    """The key store at ``db``: a PostgreSQL DSN, or a SQLite path ("": the default file). A
    database that cannot be reached is a ConnectionError naming why (never the DSN: it may hold
    a password)."""
    if not is_postgres(db):
        return KeyStore(sqlite_path(db))
    import psycopg

    from cloud_tier.gateway.tenants.keys_pg import PgKeyStore

    try:
        return PgKeyStore(db)
    except psycopg.OperationalError as e:
        raise ConnectionError(f"cannot use the PostgreSQL key store: {str(e).strip().splitlines()[0]}") from e


def open_spend(keys: KeyRecords, redis_url: str) -> SpendCounters:
    if not redis_url:
        return keys
    from cloud_tier.gateway.tenants.budgets import RedisSpend

    return RedisSpend(redis_url)


@dataclass
class Stores:
    keys: KeyRecords
    idempotency: IdempotencyRecords
    quotas: object  # Quotas | tenants.quotas_redis.RedisQuotas: admit(), reconcile()
    cache: object  # ResultCache | result_cache_redis.RedisResultCache: get(), put(), stats
    budgets: Budgets
    redis_parts: list = field(default_factory=list)  # what holds a Redis client, closed with the rest
    state: RequestState | None = None  # what the request path awaits of the cache, quotas and spend

    def __post_init__(self):
        if self.state is None:
            self.state = LocalState(self.quotas, self.cache, self.budgets.spend)

    def close(self) -> None:
        for part in self.redis_parts:
            part.close()
        self.idempotency.close()
        self.keys.close()

    async def aclose(self) -> None:
        """``close``, and first what was opened in the event loop (the async Redis client, the
        PostgreSQL pools, the key store's listener)."""
        try:
            await self.state.aclose()
            for part in (self.idempotency, self.keys):
                if hasattr(part, "aclose"):
                    await part.aclose()
        finally:
            self.close()


def open_stores(config: CloudConfig) -> Stores:
    """Open every store the gateway's ``[gateway]`` section names (close them with ``close()``)."""
    g = config.gateway
    keys = open_key_store(g.db)
    opened: list = [keys]
    try:
        if is_postgres(g.db):
            from sync.idempotency_pg import PgIdempotencyStore

            idem = PgIdempotencyStore(g.db, ttl_s=g.idempotency_ttl_s, lease_s=g.idempotency_lease_s)
        else:
            idem = IdempotencyStore(sqlite_path(g.db).with_name("idempotency.db"), ttl_s=g.idempotency_ttl_s,
                                    lease_s=g.idempotency_lease_s)
        opened.append(idem)
        if g.redis:
            from cloud_tier.gateway.pipeline.result_cache_redis import RedisResultCache
            from cloud_tier.gateway.tenants.quotas_redis import RedisQuotas

            quotas = RedisQuotas(g.redis)  # loads its script: an unreachable Redis fails the start here
            opened.append(quotas)
            cache = RedisResultCache(g.redis, g.result_cache_bytes, g.result_cache_ttl_s,
                                     tenant_entries=g.result_cache_tenant_entries,
                                     tenant_bytes=g.result_cache_tenant_bytes)
            opened.append(cache)
        else:
            quotas, cache = Quotas(), ResultCache(g.result_cache_entries, g.result_cache_bytes, g.result_cache_ttl_s)
        spend = open_spend(keys, g.redis)
        if spend is not keys:
            opened.append(spend)
    except BaseException:
        for part in opened:
            part.close()
        raise
    state = None
    if g.redis:
        from cloud_tier.gateway.pipeline.state_redis import RedisState

        state = RedisState(g.redis, quotas, cache, spend if spend is not keys else None)
    return Stores(keys, idem, quotas, cache, Budgets(keys, spend, parse_model_prices(g.model_prices)),
                  redis_parts=opened[2:], state=state)
