"""One SQLite file per store, shared by processes: WAL, one connection guarded by a lock, and
writes in ``BEGIN IMMEDIATE`` transactions (so a writer waits for another process's lock
instead of failing). The key store, the idempotency store and the offline queue build on
``SQLiteStore``; the fleet's stores (registry, devices, rollouts), which share one file and keep
their own lock and row shapes, open it with ``connect`` and write with ``transaction``."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import sqlite_utils


def connect(path: Path | str, timeout_s: float = 10.0, synchronous: str | None = None) -> sqlite3.Connection:
    """A connection to the SQLite file ``path`` as every store here uses one: WAL (readers never
    wait for the writer), no implicit transactions (writes go through ``transaction``), usable
    from any thread (its owner guards it with a lock), waiting up to ``timeout_s`` for another
    process's write lock. ``synchronous``: the PRAGMA's value, None for SQLite's default (FULL)."""
    conn = sqlite3.connect(str(path), timeout=timeout_s, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA journal_mode=WAL")
    if synchronous is not None:
        conn.execute(f"PRAGMA synchronous={synchronous}")
    return conn


@contextmanager
def transaction(conn: sqlite3.Connection, immediate: bool = True) -> Iterator[sqlite3.Connection]:
    """One transaction on ``conn`` (from ``connect``): committed when the block ends, rolled back
    when it raises. ``immediate``: take the write lock at once (a read-then-write block then never
    fails midway on another process's write); False: a deferred one, for blocks that only write."""
    conn.execute("BEGIN IMMEDIATE" if immediate else "BEGIN")
    try:
        yield conn
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT")


class SQLiteStore:
    def __init__(self, path: Path | str, synchronous: str = "NORMAL"):
        self._lock = threading.Lock()
        self._db = sqlite_utils.Database(connect(path, 10.0, synchronous), execute_plugins=False)

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
        with self._lock, transaction(self._db.conn) as conn:
            yield conn
