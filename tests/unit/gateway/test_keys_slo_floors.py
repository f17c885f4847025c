"""Tenants' floors on the service-level targets their requests may ask (issue 37 item 3), kept with
their limits on SQLite and PostgreSQL and set with `cascade cloud keys limits`; `cloud keys` shows
every command, revoke included (item 17)."""

import sqlite3

import pytest

from cloud_tier.gateway.tenants.keys import TenantLimits
from cloud_tier.gateway.tenants.keys_sqlite import KeyStore
from tests.unit.gateway.test_budgets_cli import run_cli
from tests.unit.gateway.test_keys import db, store  # noqa: F401  (the fixtures: SQLite and PostgreSQL)


def test_a_tenants_floors_are_kept_beside_its_rates_and_default_to_the_gateways(store):  # noqa: F811
    store.set_tenant_limits("acme", rps=5)
    limits = store.set_tenant_limits("acme", min_tpot_slo_s=0.05)
    assert (limits.rps, limits.min_ttft_slo_s, limits.min_tpot_slo_s) == (5, 0.0, 0.05)
    assert limits.slo_floors(0.1, 0.02) == (0.1, 0.05)
    assert store.tenant_limits("nobody").slo_floors(0.1, 0.02) == (0.1, 0.02)
    with pytest.raises(ValueError, match="min_ttft_slo_s"):
        store.set_tenant_limits("acme", min_ttft_slo_s=-1)
    assert store.tenant_limits("acme").min_ttft_slo_s == 0.0


def test_a_key_store_from_before_the_floors_gets_them(tmp_path):
    path = tmp_path / "old.db"
    with sqlite3.connect(path) as conn:
        conn.execute("CREATE TABLE tenants (name TEXT PRIMARY KEY, rps FLOAT NOT NULL, tpm FLOAT NOT NULL, "
                     "created_at FLOAT NOT NULL)")
        conn.execute("INSERT INTO tenants VALUES ('acme', 3, 0, 0)")
    s = KeyStore(path)
    assert s.tenant_limits("acme") == TenantLimits("acme", rps=3)
    s.close()


def test_cloud_keys_limits_sets_and_shows_them(capsys, tmp_path):
    path = str(tmp_path / "gateway.db")
    rc, out = run_cli(capsys, "keys", "limits", "acme", "--db", path, "--min-tpot-slo-s", "0.05", "--rps", "2")
    assert rc == 0 and "min tpot_slo_s 0.05 s" in out.out and "rps 2" in out.out
    rc, out = run_cli(capsys, "keys", "limits", "acme", "--db", path)
    assert rc == 0 and "min ttft_slo_s the gateway's" in out.out and "min tpot_slo_s 0.05 s" in out.out
    rc, out = run_cli(capsys, "keys", "limits", "acme", "--db", path, "--min-ttft-slo-s", "nan")
    assert rc == 2 and out.err.startswith("cascade: ") and out.err.count("\n") == 1


def test_cloud_keys_shows_revoke(capsys, tmp_path):
    with pytest.raises(SystemExit):
        run_cli(capsys, "keys")
    assert "revoke" in capsys.readouterr().err  # the usage line lists the commands
    rc, out = run_cli(capsys, "keys", "create", "--db", str(tmp_path / "g.db"), "--tenant", "acme")
    key_id = out.out.rstrip("\n").split("\n")[-1].split("-")[1]
    assert rc == 0 and f"cascade cloud keys revoke {key_id}" in out.out
