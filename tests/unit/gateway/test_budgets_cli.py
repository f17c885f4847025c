"""`cascade cloud keys create --budget-* / budget / list`: budgets set from the command line, shown
with this period's spend (from the key store's database, or from Redis with --redis); bad values
exit 2 with one line and write nothing."""

import argparse
import json
import uuid

import pytest

from cascade_cli.keys import add_keys_parser
from cloud_tier.gateway.tenants.budgets import Budgets, RedisSpend
from cloud_tier.gateway.tenants.keys import Budget
from cloud_tier.gateway.tenants.keys_sqlite import KeyStore


@pytest.fixture
def db(tmp_path):
    return str(tmp_path / "gateway.db")


def run_cli(capsys, *argv):
    parser = argparse.ArgumentParser(prog="cascade cloud")
    add_keys_parser(parser.add_subparsers(dest="cloud_command", required=True))
    args = parser.parse_args(list(argv))
    rc = args.func(args)
    return rc, capsys.readouterr()


def create(capsys, db, *argv) -> str:
    rc, out = run_cli(capsys, "keys", "create", "--db", db, *argv)
    assert rc == 0, out.err
    return out.out.rstrip("\n").split("\n")[-1].split("-")[1]  # the key id


def test_create_sets_the_key_and_tenant_budgets(capsys, db):
    rc, out = run_cli(capsys, "keys", "create", "--db", db, "--tenant", "acme", "--budget-tokens", "1000",
                      "--budget-period", "day", "--tenant-budget-usd", "5")
    assert rc == 0
    assert "budget 1000 tokens/day" in out.out and "budget $5/day" in out.out
    key_id = out.out.rstrip("\n").split("\n")[-1].split("-")[1]
    store = KeyStore(db)
    try:
        assert store.budget("key", key_id) == Budget(1000, 0, "day")
        assert store.budget("tenant", "acme") == Budget(0, 5, "day")
    finally:
        store.close()


def test_list_shows_budgets_and_this_periods_spend(capsys, db):
    key_id = create(capsys, db, "--tenant", "acme", "--budget-tokens", "1000", "--tenant-budget-tokens", "5000")
    store = KeyStore(db)
    try:
        key = next(k for k in store.list() if k.key_id == key_id)
        Budgets(store, store, {"smollm2-135m": (1.0, 2.0)}).charge(key, "smollm2-135m", 100, 20)
    finally:
        store.close()
    rc, out = run_cli(capsys, "keys", "list", "--db", db)
    assert rc == 0
    header, row = out.out.splitlines()[:2]
    assert header.split()[8:10] == ["BUDGET", "SPENT"]
    assert "1000 tokens/month" in row and "120 tokens $0.00014" in row
    assert "5000 tokens/month" in out.out  # the tenants' table
    rc, out = run_cli(capsys, "keys", "list", "--json", "--db", db)
    (listed,) = json.loads(out.out)
    assert listed["budget"] == {"tokens": 1000, "usd": 0, "period": "month"}
    assert listed["spent"]["tokens"] == 120 and listed["spent"]["usd"] == pytest.approx(0.00014)
    assert listed["tenant_budget"]["tokens"] == 5000 and listed["tenant_spent"]["tokens"] == 120


def test_budget_sets_and_shows_a_tenants_or_a_keys_budget(capsys, db):
    key_id = create(capsys, db, "--tenant", "acme")
    rc, out = run_cli(capsys, "keys", "budget", "--db", db, "--tenant", "acme", "--tokens", "500")
    assert rc == 0 and out.out.startswith("tenant acme: budget 500 tokens/month; spent 0 tokens")
    rc, out = run_cli(capsys, "keys", "budget", "--db", db, "--tenant", "acme", "--key", key_id, "--usd", "2",
                      "--period", "day")
    assert rc == 0 and out.out.startswith(f"key {key_id}: budget $2/day")
    rc, out = run_cli(capsys, "keys", "budget", "--db", db, "--tenant", "acme", "--tokens", "0")  # 0: none
    assert rc == 0 and "budget none" in out.out
    rc, out = run_cli(capsys, "keys", "budget", "--db", db, "--tenant", "globex", "--key", key_id, "--tokens", "1")
    assert rc == 1 and out.err == f"cascade: no key with id {key_id} in tenant globex\n"


@pytest.mark.parametrize("argv", [
    ["keys", "create", "--tenant", "acme", "--budget-tokens", "-5"],
    ["keys", "create", "--tenant", "acme", "--tenant-budget-usd", "nan"],
    ["keys", "budget", "--tenant", "acme", "--usd", "-1"],
    ["keys", "budget", "--tenant", "bad name", "--tokens", "1"],
])
def test_bad_values_exit_2_with_one_line_and_write_nothing(capsys, db, argv):
    rc, out = run_cli(capsys, *argv, "--db", db)
    assert rc == 2 and out.out == ""
    assert out.err.startswith("cascade: ") and out.err.count("\n") == 1
    rc, out = run_cli(capsys, "keys", "list", "--json", "--db", db)
    assert json.loads(out.out) == []
    store = KeyStore(db)
    try:
        assert store.budget("tenant", "acme") == Budget()
    finally:
        store.close()


def test_list_reads_spend_from_redis_with_redis(capsys, db, redis_url):
    tenant = f"t-{uuid.uuid4().hex[:8]}"  # counters of its own in the session's Redis
    key_id = create(capsys, db, "--tenant", tenant)
    store, spend = KeyStore(db), RedisSpend(redis_url)
    try:
        Budgets(store, spend, {}).charge(store.list()[0], "m", 30, 12)
    finally:
        store.close()
        spend.close()
    rc, out = run_cli(capsys, "keys", "list", "--json", "--db", db, "--redis", redis_url)
    (listed,) = json.loads(out.out)
    assert rc == 0 and (listed["spent"]["tokens"], listed["tenant_spent"]["tokens"]) == (42, 42)
    rc, out = run_cli(capsys, "keys", "list", "--json", "--db", db)  # without Redis: the database's (none)
    (listed,) = json.loads(out.out)
    assert (listed["key_id"], listed["spent"]["tokens"]) == (key_id, 0)
