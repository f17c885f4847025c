"""The offline queue as the app and the operator see it: one item, listings, counts and bounds,
and the operator's retry and drop (``cascade edge queue``). A part of ``OfflineQueue``."""

from __future__ import annotations

from collections.abc import Iterable

from sync.items import COLUMNS, O_COLUMNS, PENDING, Item, Kind, State, item_of

MAX_LIST = 1_000_000  # the most items one listing returns


class QueueView:
    """Read and operator methods of ``OfflineQueue`` (which provides ``_lock``, ``_db``,
    ``_write``, ``_clock``, ``ttl_s``, ``keep_s`` and the bounds)."""

    def get(self, item_id: str) -> Item | None:
        with self._lock:
            row = self._db.conn.execute(
                f"SELECT {O_COLUMNS}, i.status, i.result "
                "FROM outbox AS o LEFT JOIN inbox AS i ON i.id = o.id WHERE o.id = ?", (item_id,)).fetchone()
        return None if row is None else item_of(row, with_result=True)

    def by_app_key(self, app_key: str) -> Item | None:
        """The item stored under the app's own Idempotency-Key, if any (with its payload)."""
        with self._lock:
            row = self._db.conn.execute("SELECT id FROM outbox WHERE app_key = ?", (app_key,)).fetchone()
        return None if row is None else self.get(row[0])

    def items(self, state: str | None = None, kind: str | None = None, limit: int = 100) -> list[Item]:
        """Items, oldest first, at most ``limit`` (1..MAX_LIST)."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_LIST:
            raise ValueError(f"limit must be in 1..{MAX_LIST}, got {limit!r}")
        where, args = [], []
        if state:
            where.append("state = ?")
            args.append(State(state).value)
        if kind:
            where.append("kind = ?")
            args.append(Kind(kind).value)
        sql = f"SELECT {COLUMNS} FROM outbox {'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY seq LIMIT ?"
        with self._lock:
            rows = self._db.conn.execute(sql, (*args, limit)).fetchall()
        return [item_of(r) for r in rows]

    def stats(self) -> dict:
        """Counts by state and kind, bytes, the oldest pending item's age, dropped telemetry."""
        now = self._clock()
        with self._lock:
            conn = self._db.conn
            by = {k.value: dict.fromkeys((s.value for s in State), 0) for k in Kind}
            for kind, state, n in conn.execute("SELECT kind, state, count(*) FROM outbox GROUP BY kind, state"):
                by.setdefault(kind, {})[state] = n
            pending = self._pending(conn)
            oldest = conn.execute(f"SELECT min(created_at) FROM outbox WHERE state IN {PENDING}").fetchone()[0]
            total = conn.execute("SELECT coalesce(sum(bytes), 0) FROM outbox").fetchone()[0]
            counters = dict(conn.execute("SELECT name, value FROM counters").fetchall())
        return {"by_kind": by, "pending_items": pending["items"], "pending_bytes": pending["bytes"],
                "bytes": total, "oldest_pending_age_s": round(now - oldest, 3) if oldest is not None else None,
                "max_items": self.max_items, "max_bytes": self.max_bytes,
                "telemetry_dropped": counters.get("telemetry_dropped", 0)}

    @staticmethod
    def _pending(conn) -> dict:
        counts = dict(conn.execute(
            "SELECT name, value FROM counters WHERE name IN ('pending_items', 'pending_bytes')").fetchall())
        return {"items": counts.get("pending_items", 0), "bytes": counts.get("pending_bytes", 0)}

    def pending(self) -> dict:
        """Pending items and bytes, and the oldest pending item's age: cheap (no scan)."""
        with self._lock:
            conn = self._db.conn
            out = self._pending(conn)
            oldest = conn.execute(
                f"SELECT min(created_at) FROM outbox WHERE state IN {PENDING}").fetchone()[0]
        out["oldest_age_s"] = round(self._clock() - oldest, 3) if oldest is not None else None
        return out

    def retry(self, ids: Iterable[str] = (), state: str | None = None) -> int:
        """Queue failed or expired items (the given ids, or every one in ``state``) again, due now,
        with a fresh TTL. Returns how many."""
        now = self._clock()
        ids = list(ids)
        states = ("failed", "expired") if state is None else (State(state).value,)
        if not set(states) <= {"failed", "expired"}:
            raise ValueError("only failed or expired items can be retried")
        sel, args = self._select(ids, states, None)
        with self._write() as conn:
            rows = conn.execute(f"SELECT seq, kind FROM outbox WHERE {sel}", args).fetchall()
            for seq, kind in rows:
                conn.execute("UPDATE outbox SET state = 'queued', next_attempt_at = 0, expires_at = ?, "
                             "updated_at = ?, last_error = '', failures = 0 WHERE seq = ?",
                             (now + self.ttl_s[kind], now, seq))
            conn.executemany("DELETE FROM inbox WHERE id = (SELECT id FROM outbox WHERE seq = ?)",
                             [(seq,) for seq, _ in rows])
        return len(rows)

    def drop(self, ids: Iterable[str] = (), state: str | None = None, kind: str | None = None) -> int:
        """Delete items (the given ids, or all in ``state`` and/or of ``kind``), results included."""
        ids = list(ids)
        if not ids and state is None and kind is None:
            raise ValueError("name the items to drop: ids, a state or a kind")
        sel, args = self._select(ids, (State(state).value,) if state else None, kind)
        with self._write() as conn:
            conn.execute(f"DELETE FROM inbox WHERE id IN (SELECT id FROM outbox WHERE {sel})", args)
            return conn.execute(f"DELETE FROM outbox WHERE {sel}", args).rowcount

    @staticmethod
    def _select(ids: list[str], states: tuple[str, ...] | None, kind: str | None) -> tuple[str, list]:
        where, args = [], []
        if ids:
            where.append(f"id IN ({', '.join('?' * len(ids))})")
            args += ids
        if states:
            where.append(f"state IN ({', '.join('?' * len(states))})")
            args += states
        if kind:
            where.append("kind = ?")
            args.append(Kind(kind).value)
        return " AND ".join(where) or "1", args

    def collect(self) -> int:
        """Delete finished items (and their results) older than ``keep_s``."""
        cutoff = self._clock() - self.keep_s
        with self._write() as conn:
            conn.execute("DELETE FROM inbox WHERE id IN (SELECT id FROM outbox WHERE state IN "
                         "('done', 'failed', 'expired') AND updated_at <= ?)", (cutoff,))
            return conn.execute("DELETE FROM outbox WHERE state IN ('done', 'failed', 'expired') AND updated_at <= ?",
                                (cutoff,)).rowcount
