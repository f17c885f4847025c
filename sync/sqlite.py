"""One SQLite file per store, shared by processes: WAL, one connection guarded by a lock, and
writes in ``BEGIN IMMEDIATE`` transactions (so a writer waits for another process's lock
instead of failing). The key store, the idempotency store and the offline queue build on it."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import sqlite_utils


class SQLiteStore:
    def __init__(self, path: Path | str, synchronous: str = "NORMAL"):
        self._lock = threading.Lock()
        # isolation_level=None: no implicit transactions; writes use BEGIN IMMEDIATE below
        conn = sqlite3.connect(str(path), timeout=10.0, isolation_level=None, check_same_thread=False)
        self._db = sqlite_utils.Database(conn, execute_plugins=False)
        self._db.enable_wal()
        conn.execute(f"PRAGMA synchronous={synchronous}")

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _read(self, sql: str, params: Sequence = ()) -> list[dict]:
        """The rows of one query, as dicts (``sync.postgres.PgStore`` has the same)."""
        with self._lock:
            return list(self._db.query(sql, params))

    @contextmanager
    def _write(self) -> Iterator[sqlite3.Connection]:
        """A write transaction. sqlite-utils' ``create()`` reads then writes in a deferred
        transaction, which fails at once when another process writes in between: schema
        changes go through here too."""
        with self._lock:
            conn = self._db.conn
            conn.execute("BEGIN IMMEDIATE")
            try:
                yield conn
            except BaseException:
                conn.execute("ROLLBACK")
                raise
            conn.execute("COMMIT")
