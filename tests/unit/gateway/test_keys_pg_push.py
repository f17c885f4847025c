"""Key lookups cached long on each replica, with every revocation and every change of limits or
budgets pushed to all of them (PostgreSQL LISTEN/NOTIFY, ``keys_pg``); the request path's
database calls awaited through an async pool, so a PostgreSQL that stops fails those requests
with a 503 and they succeed again when it is back. Real PostgreSQL, reached directly or through a
fault-injecting proxy (tests/fault_proxy.py)."""

from __future__ import annotations

import asyncio
import time
import types

import psycopg
import pytest

from cascade import errors
from cloud_tier.gateway.pipeline.service import GatewayService
from cloud_tier.gateway.tenants.keys import Budget, TenantLimits
from cloud_tier.gateway.tenants.keys_pg import CHANNEL, PgKeyStore
from sync.postgres import StoreUnavailable
from tests.fault_proxy import FaultProxy
from tests.pg_redis import fresh_database


@pytest.fixture
def dsn(postgres_dsn):
    return fresh_database(postgres_dsn)


async def until(check, timeout_s: float = 5.0, what: str = "") -> float:
    """Seconds until ``await check()`` is true (fails the test past ``timeout_s``)."""
    start = time.monotonic()
    while not await check():
        assert time.monotonic() - start < timeout_s, f"not within {timeout_s} s: {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def listening(store: PgKeyStore) -> None:
    store.start_listening()

    async def ready():
        return store.listening

    await until(ready, what="the listener connects")


def test_a_revocation_made_anywhere_reaches_the_other_replica_within_a_second(dsn):
    replica_a, replica_b, cli = PgKeyStore(dsn), PgKeyStore(dsn), PgKeyStore(dsn)
    plaintext, key = cli.create("acme")
    second, key2 = cli.create("acme")

    async def run():
        await listening(replica_b)
        assert await replica_b.verify_async(plaintext) == key  # cached now, trusted for 300 s while listening
        assert replica_b._ttl() == replica_b.listened_ttl_s >= 60
        replica_a.revoke(key.key_id)  # another replica

        async def refused():
            return await replica_b.verify_async(plaintext) is None

        assert await until(refused, 1.0, "the revocation reaches replica b") < 1.0
        assert await replica_b.verify_async(second) == key2
        cli.revoke(key2.key_id)  # `cascade cloud keys revoke`: its own process, synchronous

        async def refused2():
            return await replica_b.verify_async(second) is None

        assert await until(refused2, 1.0, "the CLI's revocation reaches replica b") < 1.0
        await replica_b.aclose()

    try:
        asyncio.run(run())
    finally:
        for s in (replica_a, replica_b, cli):
            s.close()


def test_limits_and_budgets_changed_elsewhere_are_pushed(dsn):
    replica, admin = PgKeyStore(dsn), PgKeyStore(dsn)
    admin.create("acme")

    async def run():
        await listening(replica)
        assert await replica.tenant_limits_async("acme") == TenantLimits("acme")
        assert await replica.budget_async("tenant", "acme") == Budget()
        admin.set_tenant_limits("acme", rps=7)
        admin.set_budget("tenant", "acme", tokens=100, period="day")

        async def pushed():
            return ((await replica.tenant_limits_async("acme")).rps == 7
                    and await replica.budget_async("tenant", "acme") == Budget(100, 0, "day"))

        assert await until(pushed, 1.0, "the limits and the budget reach the replica") < 1.0
        await replica.aclose()

    try:
        asyncio.run(run())
    finally:
        replica.close()
        admin.close()


def test_a_malformed_notification_is_ignored_and_counted(dsn):
    replica, admin = PgKeyStore(dsn), PgKeyStore(dsn)
    plaintext, key = admin.create("acme")

    async def run():
        await listening(replica)
        assert await replica.verify_async(plaintext) == key
        with psycopg.connect(dsn, autocommit=True) as conn:
            for payload in ("not json", "[1, 2]", '{"key": 5}', '{"budget": ["tenant"]}', '{"what": "x"}',
                            '{"key": "a", "limits": "b"}'):
                conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, payload))

        async def counted():
            return replica.notifications_ignored == 6

        await until(counted, 2.0, "six ignored notifications")
        assert replica.listening and await replica.verify_async(plaintext) == key  # still listening, still cached
        admin.revoke(key.key_id)  # and a good one after them still works

        async def refused():
            return await replica.verify_async(plaintext) is None

        await until(refused, 1.0, "the revocation after the garbage")
        await replica.aclose()

    try:
        asyncio.run(run())
    finally:
        replica.close()
        admin.close()


def test_a_lost_listener_connection_drops_the_cache_and_reconnects(dsn):
    """Notifications sent while the listener was away are lost: on reconnecting the replica
    forgets everything it cached, so a change made meanwhile (here one that sent no NOTIFY at
    all) is read afresh."""
    replica, admin = PgKeyStore(dsn), PgKeyStore(dsn)
    plaintext, key = admin.create("acme")

    async def run():
        await listening(replica)
        assert await replica.verify_async(plaintext) == key
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE api_keys SET revoked = 1 WHERE key_id = %s", (key.key_id,))  # no NOTIFY
            conn.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE query LIKE %s "
                         "AND pid <> pg_backend_pid()", (f"LISTEN {CHANNEL}%",))

        async def refused():
            return await replica.verify_async(plaintext) is None

        await until(refused, 5.0, "the reconnected replica reads the key afresh")
        await listening(replica)
        await replica.aclose()

    try:
        asyncio.run(run())
    finally:
        replica.close()
        admin.close()


def test_a_database_that_stops_fails_the_requests_that_need_it_with_a_503_and_they_recover(dsn):
    direct = PgKeyStore(dsn)
    plaintext, key = direct.create("acme")
    other, _ = direct.create("acme")
    host_port = dsn.split("@", 1)[1].split("/", 1)[0]
    proxy = FaultProxy("127.0.0.1", int(host_port.rsplit(":", 1)[1]))
    # a lost listener trusts the cache cache_ttl_s more: 30 s here, so that "cached: still served" below
    # holds however slowly a loaded machine gets there (5 s, the default, did not under a full suite)
    store = PgKeyStore(dsn.replace(host_port, f"127.0.0.1:{proxy.port}"), cache_ttl_s=30.0)
    svc = types.SimpleNamespace(keys=store)

    async def run():
        assert await GatewayService.authenticate(svc, f"Bearer {plaintext}") == key

        async def listening():
            return store.listening

        # the listener's first connection drops what was read meanwhile (it may have missed a change):
        # the key is cached by a read after it
        await until(listening, 10.0, "the replica listens")
        assert await GatewayService.authenticate(svc, f"Bearer {plaintext}") == key
        store.timeout_s = 1.0  # how long a request waits for a connection before its 503
        proxy.down()
        await asyncio.sleep(0.1)
        ticks = 0

        async def ticker():  # the event loop keeps turning while requests wait on the database
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        t = asyncio.get_running_loop().create_task(ticker())
        started = time.monotonic()
        for _ in range(3):  # the pool's broken connection, then no new one within its timeout
            with pytest.raises(errors.APIError) as e:
                await GatewayService.authenticate(svc, f"Bearer {other}")  # not cached: needs the database
            assert e.value.status == 503 and e.value.code == "state_unavailable"
            assert e.value.headers["Retry-After"]
        waited = time.monotonic() - started
        t.cancel()
        assert 0.5 <= waited < 10 and ticks >= waited / 0.01 * 0.3
        assert await GatewayService.authenticate(svc, f"Bearer {plaintext}") == key  # cached: still served
        proxy.up()

        async def back():
            try:
                return await store.verify_async(other) is not None
            except StoreUnavailable:
                return False

        await until(back, 10.0, "the pool reconnects")

    async def guarded():
        try:
            await asyncio.wait_for(run(), 60)
        finally:
            await store.aclose()

    try:
        asyncio.run(guarded())
    finally:
        store.close()
        direct.close()
        proxy.close()
