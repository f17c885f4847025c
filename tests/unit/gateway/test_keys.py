import argparse
import contextlib
import json
import re
import sqlite3

import pytest

from cascade_cli.keys import add_keys_parser
from cloud_tier.gateway.tenants.keys import ApiKey, TenantLimits
from cloud_tier.gateway.tenants.keys_pg import PgKeyStore
from cloud_tier.gateway.tenants.keys_sqlite import KeyStore
from tests.pg_redis import fresh_database


class FakeClock:
    def __init__(self, t: float = 1000.0):
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def db(tmp_path):
    return tmp_path / "gateway.db"


@pytest.fixture(params=["sqlite", "postgres"])
def store(request, db):
    """The key store on SQLite and on PostgreSQL (a fresh database): the tests that use it run on both."""
    s = KeyStore(db) if request.param == "sqlite" else PgKeyStore(fresh_database(request.getfixturevalue(
        "postgres_dsn")))
    yield s
    s.close()


def test_created_key_verifies_to_its_record(store):
    plaintext, key = store.create("acme", device="pi-7", rps=2, tpm=1000)
    assert re.fullmatch(r"csk-[a-z0-9]{8}-[A-Za-z0-9_-]{43}", plaintext)
    assert plaintext.startswith(f"csk-{key.key_id}-")
    assert key == ApiKey(key_id=key.key_id, tenant="acme", device="pi-7",
                         scopes=frozenset({"infer"}), rps=2.0, tpm=1000.0,
                         created_at=key.created_at)
    assert store.verify(plaintext) == key
    assert store.verify(plaintext) == key  # from the cache


def test_new_tenant_gets_a_row_without_limits(store):
    store.create("acme")
    assert store.tenant_limits("acme") == TenantLimits("acme", 0.0, 0.0)
    assert store.set_tenant_limits("acme", rps=5) == TenantLimits("acme", 5.0, 0.0)
    assert store.set_tenant_limits("acme", tpm=60) == TenantLimits("acme", 5.0, 60.0)
    assert store.tenant_limits("acme") == TenantLimits("acme", 5.0, 60.0)
    store.create("acme")  # a second key leaves the tenant's limits alone
    assert store.tenant_limits("acme") == TenantLimits("acme", 5.0, 60.0)


def test_revoked_key_no_longer_verifies(store):
    plaintext, key = store.create("acme")
    assert store.verify(plaintext) is not None
    assert store.revoke(key.key_id) is True
    assert store.verify(plaintext) is None
    assert store.revoke(key.key_id) is True  # already revoked
    assert store.revoke("zzzzzzzz") is False
    assert [k.revoked for k in store.list()] == [True]


@pytest.mark.parametrize("presented", [
    "", "csk-", "Bearer csk-abcdefgh-" + "a" * 43, "csk-ABCDEFGH-" + "a" * 43,
    "csk-abcdefg-" + "a" * 43, "csk-abcdefgh-" + "a" * 42, "csk-abcdefgh-" + "a" * 44,
    "csk-abcdefgh-" + "a" * 42 + "!", "sk-abcdefgh-" + "a" * 43, None, 12345, b"csk-",
])
def test_malformed_keys_are_refused(store, presented):
    store.create("acme")
    assert store.verify(presented) is None


def test_right_id_with_wrong_secret_is_refused(store):
    plaintext, key = store.create("acme")
    store.verify(plaintext)  # cached
    forged = f"csk-{key.key_id}-" + "A" * 43
    assert store.verify(forged) is None
    assert store.verify(plaintext[:-1] + ("a" if plaintext[-1] != "a" else "b")) is None


def test_only_the_hash_is_stored(db):
    store = KeyStore(db)
    plaintext, key = store.create("acme", device="pi-7")
    store.verify(plaintext)
    store.close()
    secret = plaintext.split("-", 2)[2].encode()
    raw = b"".join(p.read_bytes() for p in db.parent.iterdir() if p.name.startswith(db.name))
    assert plaintext.encode() not in raw and secret not in raw
    assert key.key_id.encode() in raw  # the public id is stored as is
    with sqlite3.connect(db) as conn:
        (stored,) = conn.execute("SELECT key_hash FROM api_keys").fetchone()
    assert re.fullmatch(r"[0-9a-f]{64}", stored)


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "pi-7", "scopes": ("infer", "admin")}, "device keys cannot be admin"),
    ({"scopes": ("infer", "root")}, "unknown scope"),
    ({"scopes": ()}, "at least one scope"),
    ({"rps": -1}, "rps"),
    ({"tpm": float("nan")}, "tpm"),
    ({"device": "has space"}, "device names"),
])
def test_invalid_keys_are_refused(store, kwargs, message):
    with pytest.raises(ValueError, match=message):
        store.create("acme", **kwargs)
    assert store.list() == []


@pytest.mark.parametrize("tenant", ["", "a b", "x" * 65, "acme/../x", "ténant"])
def test_invalid_tenant_names_are_refused(store, tenant):
    with pytest.raises(ValueError, match="tenant names"):
        store.create(tenant)
    with pytest.raises(ValueError, match="tenant names"):
        store.set_tenant_limits(tenant, rps=1)


def test_admin_key_without_device(store):
    plaintext, key = store.create("ops", scopes=("infer", "admin"))
    assert store.verify(plaintext).scopes == {"infer", "admin"}


def test_list_filters_by_tenant(store):
    a1 = store.create("a")[1]
    b1 = store.create("b")[1]
    a2 = store.create("a", device="d1")[1]
    assert {k.key_id for k in store.list("a")} == {a1.key_id, a2.key_id}
    assert [k.key_id for k in store.list("b")] == [b1.key_id]
    assert len(store.list()) == 3


def test_two_stores_on_one_file_see_each_others_keys(db):
    clock = FakeClock()
    gateway = KeyStore(db, cache_ttl_s=5, clock=clock)
    admin = KeyStore(db, cache_ttl_s=5, clock=clock)
    try:
        plaintext, key = admin.create("acme")
        assert gateway.verify(plaintext) == key
        admin.set_tenant_limits("acme", rps=3)
        assert gateway.tenant_limits("acme").rps == 3

        admin.revoke(key.key_id)
        admin.set_tenant_limits("acme", rps=9)
        clock.t += 4.9  # within the cache TTL the gateway still answers from its cache
        assert gateway.verify(plaintext) == key
        assert gateway.tenant_limits("acme").rps == 3
        clock.t += 0.2
        assert gateway.verify(plaintext) is None
        assert gateway.tenant_limits("acme").rps == 9
    finally:
        gateway.close()
        admin.close()


def test_a_cached_key_verifies_without_reading_the_database(db):
    """The hot path: within the TTL a verify is answered from memory (its speed is bench/'s to show).
    The row is deleted behind the store's back, so any read of the database would refuse the key."""
    clock = FakeClock()
    store = KeyStore(db, cache_ttl_s=5, clock=clock)
    try:
        plaintext, key = store.create("acme")
        assert store.verify(plaintext) == key  # loads the row into the cache
        with contextlib.closing(sqlite3.connect(db)) as conn, conn:
            assert conn.execute("DELETE FROM api_keys").rowcount == 1
        assert store.verify(plaintext) == key
        assert store.verify(plaintext[:-1] + ("a" if plaintext[-1] != "a" else "b")) is None  # still checked
        clock.t += 5
        assert store.verify(plaintext) is None  # the TTL is up: read again, and the row is gone
    finally:
        store.close()


# --- the CLI -----------------------------------------------------------------------------------

def run_cli(argv, db):
    parser = argparse.ArgumentParser(prog="cascade cloud")
    add_keys_parser(parser.add_subparsers(dest="cloud_command", required=True))
    args = parser.parse_args([*argv, "--db", str(db)])
    return args.func(args)


def test_cli_create_prints_the_key_alone_on_the_last_line(db, capsys):
    rc = run_cli(["keys", "create", "--tenant", "acme", "--device", "pi-7", "--rps", "2",
                  "--tenant-rps", "10"], db)
    out = capsys.readouterr().out
    assert rc == 0
    *description, last = out.rstrip("\n").split("\n")
    assert "acme" in "\n".join(description) and "pi-7" in "\n".join(description)
    store = KeyStore(db)
    try:
        key = store.verify(last)
        assert key is not None and key.tenant == "acme" and key.device == "pi-7"
        assert key.rps == 2 and key.key_id in description[0]
        assert store.tenant_limits("acme") == TenantLimits("acme", 10.0, 0.0)
    finally:
        store.close()


def test_cli_refuses_an_admin_device_key(db, capsys):
    rc = run_cli(["keys", "create", "--tenant", "acme", "--device", "x", "--admin"], db)
    captured = capsys.readouterr()
    assert rc == 2
    assert captured.out == ""
    assert captured.err == "cascade: device keys cannot be admin\n"


def test_cli_bad_tenant_limit_writes_nothing(db, capsys):
    assert run_cli(["keys", "create", "--tenant", "acme", "--tenant-rps", "-1"], db) == 2
    assert capsys.readouterr().err.startswith("cascade: ")
    assert run_cli(["keys", "list", "--json"], db) == 0
    assert json.loads(capsys.readouterr().out) == []


def test_cli_list_and_revoke(db, capsys):
    run_cli(["keys", "create", "--tenant", "acme"], db)
    plaintext = capsys.readouterr().out.rstrip("\n").split("\n")[-1]
    key_id = plaintext.split("-")[1]

    assert run_cli(["keys", "list"], db) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:2] == ["KEY", "ID"]
    assert key_id in table and "acme" in table and plaintext not in table

    assert run_cli(["keys", "revoke", key_id], db) == 0
    assert run_cli(["keys", "revoke", "nokey000"], db) == 1
    capsys.readouterr()

    assert run_cli(["keys", "list", "--tenant", "acme", "--json"], db) == 0
    out = capsys.readouterr().out
    listed = json.loads(out)
    assert [(k["key_id"], k["tenant"], k["scopes"], k["revoked"]) for k in listed] == [
        (key_id, "acme", ["infer"], True)]
    assert plaintext not in out and "hash" not in out


def test_cli_default_db_is_under_cascade_home(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path / "home"))
    parser = argparse.ArgumentParser()
    add_keys_parser(parser.add_subparsers())
    args = parser.parse_args(["keys", "create", "--tenant", "acme"])
    assert args.func(args) == 0
    assert (tmp_path / "home" / "cloud" / "gateway.db").is_file()


# --- priority ----------------------------------------------------------------------------------

def test_a_key_carries_its_priority_default_zero(store):
    plain, key = store.create("acme")
    assert key.priority == 0 and store.verify(plain).priority == 0
    plain, key = store.create("acme", priority=5)
    assert key.priority == 5 and store.verify(plain).priority == 5
    assert [k.priority for k in store.list("acme")] == [0, 5]


@pytest.mark.parametrize("priority", [2**31, -(2**31) - 1, 1.5, True, "5"])
def test_a_priority_outside_int32_or_not_an_int_is_refused(store, priority):
    with pytest.raises(ValueError, match="priority"):
        store.create("acme", priority=priority)
    assert store.list() == []


def test_a_database_from_before_priorities_gets_them_at_zero(db):
    with contextlib.closing(sqlite3.connect(db)) as conn, conn:
        conn.execute("CREATE TABLE tenants (name TEXT PRIMARY KEY, rps FLOAT NOT NULL, tpm FLOAT NOT NULL, "
                     "created_at FLOAT NOT NULL)")
        conn.execute("CREATE TABLE api_keys (key_id TEXT PRIMARY KEY, key_hash TEXT NOT NULL, tenant TEXT NOT NULL, "
                     "device TEXT, scopes TEXT NOT NULL, rps FLOAT NOT NULL, tpm FLOAT NOT NULL, "
                     "created_at FLOAT NOT NULL, revoked INTEGER NOT NULL)")
        conn.execute("INSERT INTO tenants VALUES ('acme', 0, 0, 0)")
        conn.execute("INSERT INTO api_keys VALUES ('abcdefgh', 'x', 'acme', NULL, 'infer', 0, 0, 0, 0)")
    store = KeyStore(db)
    try:
        assert [k.priority for k in store.list()] == [0]
    finally:
        store.close()


def test_cli_create_sets_the_keys_priority(db, capsys):
    assert run_cli(["keys", "create", "--tenant", "acme", "--priority", "7"], db) == 0
    out = capsys.readouterr().out
    assert "priority 7" in out
    assert run_cli(["keys", "list", "--json"], db) == 0
    assert [k["priority"] for k in json.loads(capsys.readouterr().out)] == [7]
    assert run_cli(["keys", "create", "--tenant", "acme", "--priority", str(2**31)], db) == 2
    assert "priority" in capsys.readouterr().err
