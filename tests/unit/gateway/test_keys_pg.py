"""PgKeyStore on a real PostgreSQL, where it differs from one SQLite file: replicas share keys and
limits within the cache TTL, create concurrently, survive a dropped connection; `cascade cloud
keys --db postgresql://...`. (test_keys.py runs the key store's own suite on both backends.)"""

import argparse
import concurrent.futures
import json

import psycopg
import pytest

from cascade.processes import free_port
from cascade_cli.keys import add_keys_parser
from cloud_tier.gateway.tenants.keys import TenantLimits
from cloud_tier.gateway.tenants.keys_pg import PgKeyStore
from tests.pg_redis import fresh_database


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def dsn(postgres_dsn):
    return fresh_database(postgres_dsn)


def test_two_replicas_see_each_others_keys_and_limits_within_the_cache_ttl(dsn):
    clock = FakeClock()
    gateway, admin = PgKeyStore(dsn, cache_ttl_s=5, clock=clock), PgKeyStore(dsn, cache_ttl_s=5, clock=clock)
    try:
        plaintext, key = admin.create("acme", rps=2)
        assert gateway.verify(plaintext) == key
        admin.set_tenant_limits("acme", rps=3)
        assert gateway.tenant_limits("acme") == TenantLimits("acme", 3.0, 0.0)
        admin.revoke(key.key_id)
        admin.set_tenant_limits("acme", tpm=60)
        admin.set_budget("tenant", "acme", tokens=500, period="day")
        clock.t += 4.9  # within the TTL: the gateway's cache answers
        assert gateway.verify(plaintext) == key
        assert gateway.tenant_limits("acme").tpm == 0
        clock.t += 0.2
        assert gateway.verify(plaintext) is None
        assert gateway.tenant_limits("acme") == TenantLimits("acme", 3.0, 60.0)
        assert (gateway.budget("tenant", "acme").tokens, gateway.budget("tenant", "acme").period) == (500, "day")
    finally:
        gateway.close()
        admin.close()


def test_replicas_creating_keys_at_once_each_get_their_own(dsn):
    stores = [PgKeyStore(dsn), PgKeyStore(dsn)]
    try:
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            made = list(pool.map(lambda i: stores[i % 2].create("acme"), range(40)))
        assert len({key.key_id for _, key in made}) == 40
        assert all(stores[1].verify(plaintext) == key for plaintext, key in made)
        assert len(stores[0].list("acme")) == 40
    finally:
        for s in stores:
            s.close()


def test_a_dropped_connection_fails_one_call_and_is_replaced(dsn):
    store = PgKeyStore(dsn)
    try:
        plaintext, key = store.create("acme")
        with psycopg.connect(dsn, autocommit=True) as admin:  # as a server restart would
            admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                          "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        with pytest.raises(psycopg.OperationalError):
            store.list()
        assert [k.key_id for k in store.list()] == [key.key_id]
        assert store.verify(plaintext) == key
    finally:
        store.close()


def run_cli(argv, capsys):
    parser = argparse.ArgumentParser(prog="cascade cloud")
    add_keys_parser(parser.add_subparsers(dest="cloud_command", required=True))
    args = parser.parse_args(argv)
    rc = args.func(args)
    return rc, capsys.readouterr()


def test_cli_keys_on_a_postgresql_dsn(dsn, capsys):
    rc, out = run_cli(["keys", "create", "--tenant", "acme", "--tenant-rps", "4", "--db", dsn], capsys)
    assert rc == 0
    plaintext = out.out.rstrip("\n").split("\n")[-1]
    store = PgKeyStore(dsn)
    try:
        key = store.verify(plaintext)
        assert key is not None and store.tenant_limits("acme").rps == 4
    finally:
        store.close()
    rc, out = run_cli(["keys", "list", "--json", "--db", dsn], capsys)
    assert rc == 0 and [k["key_id"] for k in json.loads(out.out)] == [key.key_id]
    assert run_cli(["keys", "revoke", key.key_id, "--db", dsn], capsys)[0] == 0


def test_cli_with_an_unreachable_postgresql_exits_2_with_one_line(capsys):
    dsn = f"postgresql://postgres:secret@127.0.0.1:{free_port()}/postgres"
    rc, out = run_cli(["keys", "list", "--db", dsn], capsys)
    assert rc == 2 and out.out == ""
    assert out.err.startswith("cascade: cannot use the PostgreSQL key store") and out.err.count("\n") == 1
    assert "secret" not in out.err
