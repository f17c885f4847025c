"""One PostgreSQL database shared by several gateway replicas: the twin of sync/sqlite.py's
``SQLiteStore`` for the stores that have both (keys, idempotency).

One connection guarded by a lock, as with SQLite: a gateway's hot reads are cached in memory and
its writes are one short transaction each, so a pool buys little. A connection that broke (the
server restarted) fails the one call that met it and is replaced on the next. Statements are
written once for both databases: ``?`` placeholders (turned into psycopg's ``%s`` here, so no
statement may contain a literal ``?`` or ``%``) and only SQL both speak (``ON CONFLICT``,
``coalesce``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import psycopg
from psycopg.rows import dict_row

# every store creates its tables under this advisory lock: concurrent CREATE TABLE IF NOT EXISTS
# from replicas starting at once can otherwise fail on PostgreSQL's catalogue (pg_type)
_SCHEMA_LOCK = 0x63617363


class _Transaction:
    """What a ``_write()`` block gets: ``execute`` like sqlite3's (a cursor with ``rowcount`` and
    tuple rows from ``fetchone``)."""

    def __init__(self, conn: psycopg.Connection):
        self._conn = conn

    def execute(self, sql: str, params: Sequence = ()) -> psycopg.Cursor:
        return self._conn.execute(sql.replace("?", "%s"), params)


class PgStore:
    def __init__(self, dsn: str, schema: Sequence[str] = ()):
        self._dsn = dsn
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        with self._write() as tx:
            tx.execute("SELECT pg_advisory_xact_lock(?)", (_SCHEMA_LOCK,))
            for statement in schema:
                tx.execute(statement)

    def _live(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._conn is not None:
                self._conn.close()
            self._conn = psycopg.connect(self._dsn, autocommit=True, connect_timeout=10)
        return self._conn

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                self._conn.close()

    @contextmanager
    def _write(self) -> Iterator[_Transaction]:
        """A transaction (committed when the block ends, rolled back when it raises)."""
        with self._lock:
            conn = self._live()
            with conn.transaction():
                yield _Transaction(conn)

    def _read(self, sql: str, params: Sequence = ()) -> list[dict]:
        """The rows of one query, as dicts."""
        with self._lock:
            with self._live().cursor(row_factory=dict_row) as cur:
                return cur.execute(sql.replace("?", "%s"), params).fetchall()
