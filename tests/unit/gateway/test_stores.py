"""open_stores: SQLite files and in-process quotas and cache by default; PostgreSQL for a
postgresql:// db and Redis for a redis URL, shared by two gateways opened on them; the
[gateway] redis and model_prices settings are checked when the config loads."""

import pytest

from cloud_tier.config import CloudConfig, GatewayConfig
from cloud_tier.gateway.pipeline.result_cache import ResultCache
from cloud_tier.gateway.pipeline.result_cache_redis import RedisResultCache
from cloud_tier.gateway.pipeline.stores import open_stores
from cloud_tier.gateway.tenants.budgets import RedisSpend
from cloud_tier.gateway.tenants.keys_pg import PgKeyStore
from cloud_tier.gateway.tenants.keys_sqlite import KeyStore
from cloud_tier.gateway.tenants.quotas import Limits, Quotas
from cloud_tier.gateway.tenants.quotas_redis import RedisQuotas
from sync.idempotency import IdempotencyStore
from sync.idempotency_pg import PgIdempotencyStore
from tests.pg_redis import fresh_database


def config(**gateway) -> CloudConfig:
    return CloudConfig(gateway=GatewayConfig(workers="http://127.0.0.1:1", **gateway))


def test_the_embedded_default_is_sqlite_and_this_process(tmp_path, monkeypatch):
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    stores = open_stores(config())
    try:
        assert isinstance(stores.keys, KeyStore) and isinstance(stores.idempotency, IdempotencyStore)
        assert isinstance(stores.quotas, Quotas) and isinstance(stores.cache, ResultCache)
        assert stores.budgets.spend is stores.keys
        assert sorted(p.name for p in (tmp_path / "cloud").glob("*.db")) == ["gateway.db", "idempotency.db"]
    finally:
        stores.close()


def test_postgresql_and_redis_are_shared_by_two_gateways(postgres_dsn, redis_url):
    dsn = fresh_database(postgres_dsn)
    a = open_stores(config(db=dsn, redis=redis_url, model_prices="m=1:2"))
    b = open_stores(config(db=dsn.replace("postgresql://", "postgres://"), redis=redis_url))
    try:
        assert isinstance(a.keys, PgKeyStore) and isinstance(a.idempotency, PgIdempotencyStore)
        assert isinstance(a.quotas, RedisQuotas) and isinstance(a.cache, RedisResultCache)
        assert isinstance(a.budgets.spend, RedisSpend) and a.budgets.prices == {"m": (1.0, 2.0)}
        plaintext, key = a.keys.create("stores-test")
        assert b.keys.verify(plaintext) == key
        assert a.idempotency.claim("stores-test", "k", "h").state == "new"
        assert b.idempotency.claim("stores-test", "k", "h").state == "in_progress"
        assert a.quotas.admit("stores-test", key.key_id, Limits(rps=1), Limits(), 0).allowed
        assert not b.quotas.admit("stores-test", key.key_id, Limits(rps=1), Limits(), 0).allowed
        a.cache.put(f"stores-test-{key.key_id}", {"events": []}, 10)
        assert b.cache.get(f"stores-test-{key.key_id}") == {"events": []}
    finally:
        a.close()
        b.close()


def test_an_unreachable_redis_fails_the_start(tmp_path, monkeypatch):
    from cascade.processes import free_port

    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    with pytest.raises(Exception, match="(?i)connect"):
        open_stores(config(redis=f"redis://127.0.0.1:{free_port()}/0"))


@pytest.mark.parametrize("gateway, message", [
    ({"redis": "http://localhost:6379"}, "redis://"),
    ({"model_prices": "smollm2-135m=0.15"}, "model_prices"),
    ({"model_prices": "a=1:2,b=-1:2"}, "model_prices"),
])
def test_bad_redis_urls_and_prices_are_refused_by_the_config(gateway, message):
    with pytest.raises(ValueError, match=message):
        config(**gateway)


def test_config_keys_come_from_the_environment():
    c = CloudConfig.load(environ={"CASCADE_CLOUD_GATEWAY_WORKERS": "http://x:1", "CASCADE_CLOUD_GATEWAY_REDIS":
                                  "redis://r:6379/0", "CASCADE_CLOUD_GATEWAY_MODEL_PRICES": "m=0.15:0.60"})
    assert (c.gateway.redis, c.gateway.model_prices) == ("redis://r:6379/0", "m=0.15:0.60")
