"""The Idempotency-Key store in PostgreSQL, shared by gateway replicas: the semantics of
``sync.idempotency`` (one implementation, ``IdempotencyRecords``) on ``sync.postgres.PgStore``.
A claim is atomic across replicas: ``INSERT ... ON CONFLICT DO NOTHING`` takes a new key, and a
key that exists is read ``FOR UPDATE`` before it is taken over."""

from __future__ import annotations

import time
from collections.abc import Callable

from sync.idempotency import IdempotencyRecords
from sync.postgres import PgStore

SCHEMA = (
    "CREATE TABLE IF NOT EXISTS idempotency (tenant text NOT NULL, key text NOT NULL, request_hash text NOT NULL, "
    "state text NOT NULL, result text, created_at double precision NOT NULL, "
    "updated_at double precision NOT NULL, owner text, PRIMARY KEY (tenant, key))",
    "CREATE INDEX IF NOT EXISTS idempotency_created_at ON idempotency (created_at)",
)


class PgIdempotencyStore(PgStore, IdempotencyRecords):
    _FOR_UPDATE = " FOR UPDATE"

    def __init__(self, dsn: str, ttl_s: float = 24 * 3600, clock: Callable[[], float] = time.time,
                 lease_s: float = 600.0):
        IdempotencyRecords.__init__(self, ttl_s, clock, lease_s)
        PgStore.__init__(self, dsn, SCHEMA)
