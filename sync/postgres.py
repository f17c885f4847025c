"""One PostgreSQL database shared by several gateway replicas: the twin of sync/sqlite.py's
``SQLiteStore`` for the stores that have both (keys, idempotency).

Two ways in. The request path awaits ``_atx()`` / ``_aread()``: a ``psycopg_pool``
``AsyncConnectionPool`` opened in the running event loop, so a slow or stopped database never
stalls the loop; one that cannot be reached fails the call that needed it with
``StoreUnavailable`` within ``timeout_s`` (the gateway answers 503), and the pool reconnects when
it is back. The command line, start-up (the schema) and tests call the synchronous ``_write()`` /
``_read()``: one connection guarded by a lock; a connection that broke (the server restarted)
fails the one call that met it and is replaced on the next. Statements are written once for both
databases: ``?`` placeholders (turned into psycopg's ``%s`` here, so no statement may contain a
literal ``?`` or ``%``) and only SQL both speak (``ON CONFLICT``, ``coalesce``)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager

import psycopg
from psycopg.rows import dict_row

from sync.sql_async import Rows

# every store creates its tables under this advisory lock: concurrent CREATE TABLE IF NOT EXISTS
# from replicas starting at once can otherwise fail on PostgreSQL's catalogue (pg_type)
_SCHEMA_LOCK = 0x63617363


class StoreUnavailable(ConnectionError):
    """The database could not be reached, or failed the call midway (the message never names the
    DSN: it may hold a password)."""


def _pg_sql(sql: str) -> str:
    return sql.replace("?", "%s")


class _Transaction:
    """What a ``_write()`` block gets: ``execute`` like sqlite3's (a cursor with ``rowcount`` and
    tuple rows from ``fetchone``)."""

    def __init__(self, conn: psycopg.Connection):
        self._conn = conn

    def execute(self, sql: str, params: Sequence = ()) -> psycopg.Cursor:
        return self._conn.execute(_pg_sql(sql), params)


class _AsyncTx:
    def __init__(self, conn: psycopg.AsyncConnection):
        self._conn = conn

    async def execute(self, sql: str, params: Sequence = ()) -> Rows:
        cur = await self._conn.execute(_pg_sql(sql), params)
        return Rows(cur.rowcount, await cur.fetchall() if cur.description else [])


class PgStore:
    def __init__(self, dsn: str, schema: Sequence[str] = (), pool_size: int = 8, timeout_s: float = 5.0):
        self._dsn = dsn
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self.pool_size = pool_size
        self.timeout_s = timeout_s  # how long a request waits for a connection before its 503
        self._pool = None  # psycopg_pool.AsyncConnectionPool, opened in the loop that first awaits it
        self._pool_loop: asyncio.AbstractEventLoop | None = None
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

    async def aclose(self) -> None:
        """Close the async pool (in the loop that opened it), then the synchronous connection."""
        pool, self._pool = self._pool, None
        if pool is not None and self._pool_loop is asyncio.get_running_loop():
            await pool.close()
        self.close()

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
                return cur.execute(_pg_sql(sql), params).fetchall()

    async def _apool(self):
        loop = asyncio.get_running_loop()
        if self._pool is None or self._pool_loop is not loop:
            from psycopg_pool import AsyncConnectionPool

            self._pool = AsyncConnectionPool(
                self._dsn, min_size=1, max_size=self.pool_size, timeout=self.timeout_s, open=False,
                kwargs={"autocommit": True, "connect_timeout": max(1, round(self.timeout_s))})
            self._pool_loop = loop
            await self._pool.open(wait=False)
        return self._pool

    @asynccontextmanager
    async def _aconn(self) -> AsyncIterator[psycopg.AsyncConnection]:
        from psycopg_pool import PoolTimeout

        pool = await self._apool()
        try:
            async with pool.connection(timeout=self.timeout_s) as conn:
                yield conn
        except PoolTimeout as e:
            raise StoreUnavailable(f"PostgreSQL gave no connection within {self.timeout_s:g} s") from e
        except psycopg.OperationalError as e:
            why = str(e).strip().partition("\n")[0] or repr(e)
            raise StoreUnavailable(f"PostgreSQL failed: {why}") from e

    @asynccontextmanager
    async def _atx(self) -> AsyncIterator[_AsyncTx]:
        """An awaitable transaction from the pool (committed when the block ends, rolled back when
        it raises)."""
        async with self._aconn() as conn, conn.transaction():
            yield _AsyncTx(conn)

    async def _aread(self, sql: str, params: Sequence = ()) -> list[dict]:
        async with self._aconn() as conn, conn.cursor(row_factory=dict_row) as cur:
            await cur.execute(_pg_sql(sql), params)
            return await cur.fetchall()
