"""API keys, tenant limits and budgets in SQLite (WAL): the key store's semantics
(``keys.KeyRecords``, one implementation) on ``sync.sqlite.SQLiteStore``."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from cloud_tier.gateway.tenants.keys import KeyRecords
from sync.sqlite import SQLiteStore


class KeyStore(SQLiteStore, KeyRecords):
    """API keys in SQLite (WAL), stored only as a hash; the plaintext is returned once by create().
    Several processes may open the same file."""

    def __init__(self, path: Path | str, cache_ttl_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic):
        KeyRecords.__init__(self, cache_ttl_s, clock)
        SQLiteStore.__init__(self, path)
        with self._write():
            self._db["tenants"].create(
                {"name": str, "rps": float, "tpm": float, "created_at": float},
                pk="name", not_null={"rps", "tpm", "created_at"}, if_not_exists=True)
            self._db["api_keys"].create(
                {"key_id": str, "key_hash": str, "tenant": str, "device": str, "scopes": str,
                 "rps": float, "tpm": float, "created_at": float, "revoked": int},
                pk="key_id",
                not_null={"key_hash", "tenant", "scopes", "rps", "tpm", "created_at", "revoked"},
                foreign_keys=[("tenant", "tenants", "name")], if_not_exists=True)
            self._db["api_keys"].create_index(["tenant"], if_not_exists=True)
            if "priority" not in self._db["api_keys"].columns_dict:  # a database from before priorities
                self._db["api_keys"].add_column("priority", int, not_null_default=0)
            for floor in ("min_ttft_slo_s", "min_tpot_slo_s"):  # ... or from before the tenants' SLO floors
                if floor not in self._db["tenants"].columns_dict:
                    self._db["tenants"].add_column(floor, float, not_null_default=0.0)
            self._db["budgets"].create({"scope": str, "name": str, "tokens": float, "usd": float, "period": str},
                                       pk=("scope", "name"), not_null={"tokens", "usd", "period"},
                                       if_not_exists=True)
            self._db["spend"].create({"scope": str, "name": str, "period": str, "tokens": float, "usd": float},
                                     pk=("scope", "name", "period"), not_null={"tokens", "usd"}, if_not_exists=True)
