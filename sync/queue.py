"""The device's durable outbox: escalations and telemetry kept in SQLite until delivered.

An item's life (``State``)::

    queued --claim--> sending --complete--> done      (requests: the response is in the inbox)
      ^                  |    --fail------> failed    (the cloud refused it for good)
      +---retry_later----+    --ack-------> (deleted) (telemetry: the broker has it)
      +---lease runs out, or the process restarts
    queued --its TTL passes--> expired

Guarantees:
- ``enqueue`` returns only after its transaction is committed (``synchronous=FULL`` by default:
  the WAL is fsynced at each commit), so an acknowledged item survives a crash or a power cut.
- Ids are UUIDv7 (time-sortable) and double as the ``Idempotency-Key``, so a resend after a crash
  is executed once by the cloud.
- Per-session FIFO: an item with a ``session`` is claimed only when no earlier item of its session
  is queued or sending. Among claimable items, higher ``priority`` first, then arrival order.
- Size bound (``max_items``, ``max_bytes`` over queued + sending items): to make room, the oldest
  queued telemetry is dropped first; a request that still does not fit is refused with
  ``QueueFull`` (nothing accepted is ever dropped to make room); telemetry that does not fit is
  dropped and counted.
- Finished items (done, failed, expired) keep their result for ``keep_s``, then ``collect`` deletes them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from sync.ids import new_id
from sync.sqlite import SQLiteStore


class State(StrEnum):
    QUEUED = "queued"
    SENDING = "sending"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


PENDING = (State.QUEUED.value, State.SENDING.value)


class Kind(StrEnum):
    REQUEST = "request"  # an escalation: POSTed to the cloud, its response kept in the inbox
    TELEMETRY = "telemetry"  # published over MQTT, deleted once the broker acknowledged it


class KeyReused(ValueError):
    """An app's Idempotency-Key already names a different queued request."""


class QueueFull(Exception):
    """The outbox is at its size bound and holds no telemetry to drop: the request is refused."""

    def __init__(self, message: str, stats: dict):
        super().__init__(message)
        self.stats = stats


@dataclass(frozen=True)
class NewItem:
    kind: Kind
    payload: dict
    endpoint: str = ""  # requests: "chat" | "completions"
    session: str | None = None  # items of one session are delivered in order
    priority: int = 0  # higher first
    ttl_s: float | None = None  # None: the queue's default for the kind
    callback_url: str | None = None
    reason: str = ""  # why it was queued (the escalation reason)
    app_key: str | None = None  # the app's own Idempotency-Key: the same key enqueues once
    id: str = field(default_factory=new_id)


@dataclass
class Item:
    id: str
    seq: int
    kind: str
    state: str
    endpoint: str
    session: str | None
    priority: int
    payload: dict
    bytes: int
    created_at: float
    expires_at: float
    attempts: int
    next_attempt_at: float
    last_error: str
    callback_url: str | None
    reason: str
    updated_at: float
    result_status: int | None = None  # from the inbox, once done or failed
    result: Any = None

    @classmethod
    def from_row(cls, row: dict) -> Item:
        row = dict(row)
        row.pop("lease_until", None)
        row["payload"] = json.loads(row["payload"])
        if row.get("result") is not None:
            row["result"] = json.loads(row["result"])
        return cls(**row)


_NAMES = ("seq", "id", "kind", "state", "endpoint", "session", "priority", "payload", "bytes", "created_at",
          "expires_at", "attempts", "next_attempt_at", "last_error", "callback_url", "reason", "updated_at",
          "lease_until")
_COLUMNS = ", ".join(_NAMES)
_O_COLUMNS = ", ".join(f"o.{c}" for c in _NAMES)  # the same, in a join with the inbox


class OfflineQueue(SQLiteStore):
    def __init__(self, path: Path | str, *, max_items: int = 10_000, max_bytes: int = 64 << 20,
                 request_ttl_s: float = 7 * 24 * 3600, telemetry_ttl_s: float = 24 * 3600,
                 keep_s: float = 24 * 3600, lease_s: float = 120.0, synchronous: str = "FULL",
                 clock: Callable[[], float] = time.time):
        if max_items < 1 or max_bytes < 1:
            raise ValueError("max_items and max_bytes must be >= 1")
        self.max_items, self.max_bytes = max_items, max_bytes
        self.ttl_s = {Kind.REQUEST.value: request_ttl_s, Kind.TELEMETRY.value: telemetry_ttl_s}
        self.keep_s, self.lease_s = keep_s, lease_s
        self._clock = clock
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        super().__init__(path, synchronous)
        with self._write() as conn:
            self._db["outbox"].create(
                {"seq": int, "id": str, "kind": str, "state": str, "endpoint": str, "session": str,
                 "priority": int, "payload": str, "bytes": int, "created_at": float, "expires_at": float,
                 "attempts": int, "next_attempt_at": float, "lease_until": float, "last_error": str,
                 "callback_url": str, "reason": str, "updated_at": float},
                pk="seq", not_null={"id", "kind", "state", "payload", "bytes", "created_at", "expires_at"},
                defaults={"endpoint": "", "priority": 0, "attempts": 0, "next_attempt_at": 0.0,
                          "lease_until": 0.0, "last_error": "", "reason": ""},
                if_not_exists=True)
            self._db["outbox"].create_index(["id"], unique=True, if_not_exists=True)
            self._db["outbox"].create_index(["kind", "state", "priority", "seq"], if_not_exists=True)
            self._db["outbox"].create_index(["session", "seq"], if_not_exists=True)
            self._db["inbox"].create(
                {"id": str, "status": int, "result": str, "received_at": float, "callback_state": str},
                pk="id", if_not_exists=True)
            self._db["counters"].create({"name": str, "value": int}, pk="name", if_not_exists=True)
            self._db["outbox"].create_index(["state"], if_not_exists=True)
            if "app_key" not in self._db["outbox"].columns_dict:
                conn.execute("ALTER TABLE outbox ADD COLUMN app_key TEXT")
            conn.execute("CREATE UNIQUE INDEX IF NOT EXISTS outbox_app_key ON outbox (app_key) "
                         "WHERE app_key IS NOT NULL")
            self._pending_triggers(conn)

    @staticmethod
    def _pending_triggers(conn) -> None:
        """The size bound is checked at every enqueue: the pending count and bytes are kept in
        ``counters`` by triggers (whoever changes the table, this process or the CLI), so the
        check reads two rows instead of scanning the outbox. Recounted once when opened."""
        pending = f"IN {PENDING}"
        bump = ("UPDATE counters SET value = value + {n} WHERE name = 'pending_items'; "
                "UPDATE counters SET value = value + {b} WHERE name = 'pending_bytes';")
        conn.execute(f"CREATE TRIGGER IF NOT EXISTS outbox_pending_insert AFTER INSERT ON outbox "
                     f"WHEN NEW.state {pending} BEGIN {bump.format(n=1, b='NEW.bytes')} END")
        conn.execute(f"CREATE TRIGGER IF NOT EXISTS outbox_pending_delete AFTER DELETE ON outbox "
                     f"WHEN OLD.state {pending} BEGIN {bump.format(n=-1, b='-OLD.bytes')} END")
        conn.execute(f"CREATE TRIGGER IF NOT EXISTS outbox_pending_leave AFTER UPDATE OF state ON outbox "
                     f"WHEN OLD.state {pending} AND NEW.state NOT {pending} "
                     f"BEGIN {bump.format(n=-1, b='-OLD.bytes')} END")
        conn.execute(f"CREATE TRIGGER IF NOT EXISTS outbox_pending_enter AFTER UPDATE OF state ON outbox "
                     f"WHEN OLD.state NOT {pending} AND NEW.state {pending} "
                     f"BEGIN {bump.format(n=1, b='NEW.bytes')} END")
        n, size = conn.execute(
            f"SELECT count(*), coalesce(sum(bytes), 0) FROM outbox WHERE state {pending}").fetchone()
        conn.executemany("INSERT OR REPLACE INTO counters (name, value) VALUES (?, ?)",
                         [("pending_items", n), ("pending_bytes", size)])

    # -- enqueue -------------------------------------------------------------------------

    def enqueue(self, kind: Kind | str, payload: dict, **kw) -> str | None:
        """Store one item durably; its id, or None for telemetry dropped for want of room.
        Raises QueueFull for a request that does not fit."""
        return self.enqueue_many([NewItem(Kind(kind), payload, **kw)])[0]

    def enqueue_many(self, items: Iterable[NewItem]) -> list[str | None]:
        """Store items in one transaction (one fsync): all the requests among them, or none.
        An item whose ``app_key`` is already stored is not stored again: its id is the earlier
        item's (KeyReused if that one's payload differs)."""
        items, now = list(items), self._clock()
        bodies = [json.dumps(it.payload, separators=(",", ":")) for it in items]
        with self._write() as conn:
            rows, ids = [], self._earlier_ids(conn, items, bodies)
            for it, body, item_id in zip(items, bodies, ids, strict=True):
                if item_id is None:
                    ttl = self.ttl_s[it.kind.value] if it.ttl_s is None else it.ttl_s
                    rows.append((it, body, len(body.encode()), now + ttl))
            n, size = self._pending(conn).values()
            need_n = n + len(rows) - self.max_items
            need_b = size + sum(r[2] for r in rows) - self.max_bytes
            if need_n > 0 or need_b > 0:
                need_n, need_b = self._drop_telemetry(conn, need_n, need_b)
            # what still does not fit: drop the telemetry among the new items, newest first
            keep = [True] * len(rows)
            for i in reversed(range(len(rows))):
                if need_n <= 0 and need_b <= 0:
                    break
                if rows[i][0].kind == Kind.TELEMETRY:
                    keep[i] = False
                    need_n, need_b = need_n - 1, need_b - rows[i][2]
            if need_n > 0 or need_b > 0:
                stats = self._pending(conn)
                raise QueueFull(f"the offline queue is full ({stats['items']} items, {stats['bytes']} bytes "
                                f"pending; bounds {self.max_items} items, {self.max_bytes} bytes)", stats)
            if not all(keep):
                self._count(conn, "telemetry_dropped", keep.count(False))
            stored = set()
            for (it, body, nbytes, expires_at), kept in zip(rows, keep, strict=True):
                if not kept:
                    continue
                conn.execute(
                    "INSERT INTO outbox (id, kind, state, endpoint, session, priority, payload, bytes, "
                    "created_at, expires_at, callback_url, reason, updated_at, app_key) "
                    "VALUES (?, ?, 'queued', ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (it.id, it.kind.value, it.endpoint, it.session, it.priority, body, nbytes, now, expires_at,
                     it.callback_url, it.reason, now, it.app_key))
                stored.add(it.id)
        return [item_id if item_id is not None else (it.id if it.id in stored else None)
                for it, item_id in zip(items, ids, strict=True)]

    @staticmethod
    def _earlier_ids(conn, items: list[NewItem], bodies: list[str]) -> list[str | None]:
        """For each item, the id of the item already holding its ``app_key`` (stored before, or
        earlier in this batch); None: store it."""
        holders: dict[str, tuple[str, str]] = {}  # app_key -> (id, payload)
        out: list[str | None] = []
        for it, body in zip(items, bodies, strict=True):
            holder = holders.get(it.app_key) if it.app_key is not None else None
            if it.app_key is not None and holder is None:
                row = conn.execute("SELECT id, payload FROM outbox WHERE app_key = ?", (it.app_key,)).fetchone()
                holder = holders[it.app_key] = (row[0], row[1]) if row else (it.id, body)
                if row is None:
                    out.append(None)
                    continue
            if holder is None:
                out.append(None)
                continue
            if holder[1] != body:
                raise KeyReused(f"the Idempotency-Key {it.app_key!r} was used for a different request")
            out.append(holder[0])
        return out

    def _drop_telemetry(self, conn, need_n: int, need_b: int) -> tuple[int, int]:
        """Delete the oldest queued telemetry until ``need_n`` items and ``need_b`` bytes are free."""
        dropped = []
        for seq, nbytes in conn.execute(
                "SELECT seq, bytes FROM outbox WHERE kind = 'telemetry' AND state = 'queued' ORDER BY seq"):
            if need_n <= 0 and need_b <= 0:
                break
            dropped.append(seq)
            need_n, need_b = need_n - 1, need_b - nbytes
        if dropped:
            conn.executemany("DELETE FROM outbox WHERE seq = ?", [(s,) for s in dropped])
            self._count(conn, "telemetry_dropped", len(dropped))
        return need_n, need_b

    @staticmethod
    def _count(conn, name: str, n: int) -> None:
        conn.execute("INSERT INTO counters (name, value) VALUES (?, ?) "
                     "ON CONFLICT(name) DO UPDATE SET value = value + excluded.value", (name, n))

    # -- delivery ------------------------------------------------------------------------

    def claim(self, kind: Kind | str, limit: int, lease_s: float | None = None) -> list[Item]:
        """Lease up to ``limit`` deliverable items (state sending): due, not expired, and each the
        head of its session. Expired items are marked first, so they never block a session."""
        now = self._clock()
        lease_until = now + (self.lease_s if lease_s is None else lease_s)
        with self._write() as conn:
            self._expire(conn, now)
            conn.execute("UPDATE outbox SET state = 'queued', updated_at = ? "
                         "WHERE state = 'sending' AND lease_until <= ?", (now, now))
            rows = conn.execute(
                f"SELECT {_COLUMNS} FROM outbox AS o WHERE kind = ? AND state = 'queued' "
                "AND next_attempt_at <= ? AND (session IS NULL OR NOT EXISTS ("
                f"  SELECT 1 FROM outbox AS p WHERE p.session = o.session AND p.seq < o.seq "
                f"  AND p.state IN {PENDING})) "
                "ORDER BY priority DESC, seq LIMIT ?", (Kind(kind).value, now, limit)).fetchall()
            items = [self._item(r) for r in rows]
            conn.executemany(
                "UPDATE outbox SET state = 'sending', lease_until = ?, attempts = attempts + 1, updated_at = ? "
                "WHERE seq = ?", [(lease_until, now, it.seq) for it in items])
        for it in items:
            it.state, it.attempts = State.SENDING.value, it.attempts + 1
        return items

    def complete(self, item_id: str, status: int, result: Any, failed: bool = False) -> None:
        """The cloud answered: ``done`` (or ``failed`` for a refusal) with its response in the inbox."""
        self.complete_many([(item_id, status, result, failed)])

    def complete_many(self, outcomes: Iterable[tuple[str, int, Any, bool]]) -> None:
        now = self._clock()
        with self._write() as conn:
            for item_id, status, result, failed in outcomes:
                state = State.FAILED if failed else State.DONE
                changed = conn.execute(
                    f"UPDATE outbox SET state = ?, updated_at = ?, lease_until = 0 WHERE id = ? "
                    f"AND state IN {PENDING}", (state.value, now, item_id)).rowcount
                if changed:
                    callback = conn.execute("SELECT callback_url FROM outbox WHERE id = ?", (item_id,)).fetchone()[0]
                    conn.execute(
                        "INSERT OR REPLACE INTO inbox (id, status, result, received_at, callback_state) "
                        "VALUES (?, ?, ?, ?, ?)", (item_id, status, json.dumps(result, separators=(",", ":")),
                                                   now, "pending" if callback else None))

    def ack(self, item_ids: Iterable[str]) -> int:
        """Delivered telemetry: delete it. Returns how many were still there."""
        with self._write() as conn:
            return conn.executemany("DELETE FROM outbox WHERE id = ?", [(i,) for i in item_ids]).rowcount

    def retry_later(self, item_id: str, error: str, delay_s: float) -> None:
        """A delivery attempt failed for a passing reason: back to queued, due in ``delay_s``."""
        now = self._clock()
        with self._write() as conn:
            conn.execute("UPDATE outbox SET state = 'queued', next_attempt_at = ?, last_error = ?, lease_until = 0, "
                         "updated_at = ? WHERE id = ? AND state = 'sending'", (now + delay_s, error[:500], now, item_id))

    def release(self, item_ids: Iterable[str]) -> None:
        """Give claimed items back untried (the attempt does not count)."""
        now = self._clock()
        with self._write() as conn:
            conn.executemany("UPDATE outbox SET state = 'queued', attempts = max(attempts - 1, 0), lease_until = 0, "
                             "updated_at = ? WHERE id = ? AND state = 'sending'", [(now, i) for i in item_ids])

    def recover(self) -> int:
        """At start-up: whatever a dead process was sending is queued again. Returns how many."""
        with self._write() as conn:
            return conn.execute("UPDATE outbox SET state = 'queued', lease_until = 0, updated_at = ? "
                                "WHERE state = 'sending'", (self._clock(),)).rowcount

    def expire(self) -> int:
        with self._write() as conn:
            return self._expire(conn, self._clock())

    @staticmethod
    def _expire(conn, now: float) -> int:
        """Queued items past their TTL: requests become ``expired``; telemetry is deleted."""
        conn.execute("DELETE FROM outbox WHERE kind = 'telemetry' AND state = 'queued' AND expires_at <= ?", (now,))
        return conn.execute("UPDATE outbox SET state = 'expired', updated_at = ? "
                            "WHERE state = 'queued' AND expires_at <= ?", (now, now)).rowcount

    def session_pending(self, session: str) -> bool:
        """Whether ``session`` has items queued or being sent (a new one must go behind them)."""
        with self._lock:
            return self._db.conn.execute(
                f"SELECT 1 FROM outbox WHERE session = ? AND state IN {PENDING} LIMIT 1", (session,)).fetchone() is not None

    def next_due(self, kind: Kind | str) -> float | None:
        """When the earliest queued item of ``kind`` becomes due (None: nothing queued)."""
        with self._lock:
            row = self._db.conn.execute("SELECT min(next_attempt_at) FROM outbox WHERE kind = ? AND state = 'queued'",
                                        (Kind(kind).value,)).fetchone()
        return row[0]

    # -- callbacks -----------------------------------------------------------------------

    def pending_callbacks(self, limit: int = 32) -> list[Item]:
        with self._lock:
            rows = self._db.conn.execute(
                f"SELECT {_O_COLUMNS}, i.status, i.result "
                "FROM inbox AS i JOIN outbox AS o ON o.id = i.id WHERE i.callback_state = 'pending' "
                "ORDER BY i.received_at LIMIT ?", (limit,)).fetchall()
        return [self._item(r, with_result=True) for r in rows]

    def callback_done(self, item_id: str, ok: bool) -> None:
        with self._write() as conn:
            conn.execute("UPDATE inbox SET callback_state = ? WHERE id = ?", ("done" if ok else "failed", item_id))

    # -- the app's and the operator's view ------------------------------------------------

    def get(self, item_id: str) -> Item | None:
        with self._lock:
            row = self._db.conn.execute(
                f"SELECT {_O_COLUMNS}, i.status, i.result "
                "FROM outbox AS o LEFT JOIN inbox AS i ON i.id = o.id WHERE o.id = ?", (item_id,)).fetchone()
        return None if row is None else self._item(row, with_result=True)

    def items(self, state: str | None = None, kind: str | None = None, limit: int = 100) -> list[Item]:
        where, args = [], []
        if state:
            where.append("state = ?")
            args.append(State(state).value)
        if kind:
            where.append("kind = ?")
            args.append(Kind(kind).value)
        sql = f"SELECT {_COLUMNS} FROM outbox {'WHERE ' + ' AND '.join(where) if where else ''} ORDER BY seq LIMIT ?"
        with self._lock:
            rows = self._db.conn.execute(sql, (*args, limit)).fetchall()
        return [self._item(r) for r in rows]

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
                             "updated_at = ?, last_error = '' WHERE seq = ?", (now + self.ttl_s[kind], now, seq))
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

    @staticmethod
    def _item(row, with_result: bool = False) -> Item:
        names = _NAMES + (("result_status", "result") if with_result else ())
        return Item.from_row(dict(zip(names, row, strict=True)))

