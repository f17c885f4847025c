"""One implementation of a store's SQL semantics for both of its callers: the request path, which
awaits it (PostgreSQL through an async pool, so a slow database never stalls the event loop), and
the command line and tests, which call it synchronously. A store writes each operation once as a
coroutine over ``tx.execute`` (awaitable, giving ``Rows``) and runs it either awaited on its async
backend or with ``run_now`` on its synchronous one, whose coroutine never suspends.

SQLite (a local file) is synchronous both ways: its "async" transaction is the synchronous one."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Rows:
    """What an executed statement gave: the rows it returned (tuples) and how many it touched."""

    rowcount: int
    rows: list = field(default_factory=list)

    def fetchone(self):
        return self.rows[0] if self.rows else None


def run_now(coro: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that never suspends (every await in it reaches a synchronous
    backend), run here without an event loop."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise RuntimeError("a store's operation suspended on its synchronous backend")


class SyncTx:
    """A synchronous transaction (sqlite3's or psycopg's ``execute``) behind the awaitable one."""

    def __init__(self, execute: Callable):
        self._execute = execute

    async def execute(self, sql: str, params: Sequence = ()) -> Rows:
        cur = self._execute(sql, params)
        return Rows(cur.rowcount, cur.fetchall() if cur.description else [])


class SyncBackedSql:
    """The default async side of a store whose backend is synchronous (SQLite): ``_atx`` and
    ``_aread`` are its ``_write`` and ``_read``. ``sync.postgres.PgStore`` overrides them."""

    @asynccontextmanager
    async def _stx(self) -> AsyncIterator[SyncTx]:
        """The synchronous transaction, for ``run_now``."""
        with self._write() as tx:
            yield SyncTx(tx.execute)

    def _atx(self):
        return self._stx()

    async def _aread(self, sql: str, params: Sequence = ()) -> list[dict]:
        return self._read(sql, params)

    async def _sread(self, sql: str, params: Sequence = ()) -> list[dict]:
        """The synchronous read, for ``run_now``."""
        return self._read(sql, params)
