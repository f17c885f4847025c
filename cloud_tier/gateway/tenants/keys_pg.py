"""API keys, tenant limits and budgets in PostgreSQL, shared by several gateway replicas: the key
store's semantics (``keys.KeyRecords``, one implementation) on ``sync.postgres.PgStore``. Each
replica caches what it verified for ``cache_ttl_s``, as the SQLite store does."""

from __future__ import annotations

import time
from collections.abc import Callable

from cloud_tier.gateway.tenants.keys import KeyRecords
from sync.postgres import PgStore

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS tenants (name text PRIMARY KEY, rps double precision NOT NULL, "
    "tpm double precision NOT NULL, created_at double precision NOT NULL)",
    "CREATE TABLE IF NOT EXISTS api_keys (key_id text PRIMARY KEY, key_hash text NOT NULL, "
    "tenant text NOT NULL REFERENCES tenants (name), device text, scopes text NOT NULL, "
    "rps double precision NOT NULL, tpm double precision NOT NULL, created_at double precision NOT NULL, "
    "revoked integer NOT NULL, priority integer NOT NULL DEFAULT 0)",
    "CREATE INDEX IF NOT EXISTS api_keys_tenant ON api_keys (tenant)",
    # the tenants' floors on service-level targets (a database from before them gets the columns)
    "ALTER TABLE tenants ADD COLUMN IF NOT EXISTS min_ttft_slo_s double precision NOT NULL DEFAULT 0",
    "ALTER TABLE tenants ADD COLUMN IF NOT EXISTS min_tpot_slo_s double precision NOT NULL DEFAULT 0",
    "CREATE TABLE IF NOT EXISTS budgets (scope text NOT NULL, name text NOT NULL, tokens double precision NOT NULL, "
    "usd double precision NOT NULL, period text NOT NULL, PRIMARY KEY (scope, name))",
    "CREATE TABLE IF NOT EXISTS spend (scope text NOT NULL, name text NOT NULL, period text NOT NULL, "
    "tokens double precision NOT NULL, usd double precision NOT NULL, PRIMARY KEY (scope, name, period))",
)


class PgKeyStore(PgStore, KeyRecords):
    """API keys in PostgreSQL, stored only as a hash; the plaintext is returned once by create()."""

    def __init__(self, dsn: str, cache_ttl_s: float = 5.0, clock: Callable[[], float] = time.monotonic):
        KeyRecords.__init__(self, cache_ttl_s, clock)
        PgStore.__init__(self, dsn, SCHEMA)
