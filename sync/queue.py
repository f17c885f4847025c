"""The device's durable outbox: escalations and telemetry kept in SQLite until delivered.

An item's life (``State``)::

    queued --claim--> sending --complete--> done      (requests: the response is in the inbox)
      ^                  |    --fail------> failed    (the cloud refused it for good, or it failed
      |                  |                             for a reason of its own max_attempts times)
      +---retry_later----+    --ack-------> (deleted) (telemetry: the broker has it)
      +---lease runs out, or the process restarts
    queued --its TTL passes--> expired

Guarantees:
- ``enqueue`` returns only after its transaction is committed (``synchronous=FULL`` by default:
  the WAL is fsynced at each commit), so an acknowledged item survives a crash or a power cut.
- Ids are UUIDv7 (time-sortable) and double as the ``Idempotency-Key``, so a resend after a crash
  is executed once by the cloud.
- Per-session FIFO: an item with a ``session`` is claimed only when no earlier item of its session
  is queued or sending (one that ended failed or expired no longer holds the next back). Among
  claimable items, higher ``priority`` first, then arrival order.
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
from pathlib import Path
from typing import Any

from sync.items import (
    COLUMNS,
    O_COLUMNS,
    PENDING,
    Item,
    KeyReused,
    Kind,
    NewItem,
    QueueFull,
    State,
    item_of,
)
from sync.queue_view import QueueView
from sync.sqlite import SQLiteStore


class OfflineQueue(QueueView, SQLiteStore):
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
            if "failures" not in self._db["outbox"].columns_dict:
                conn.execute("ALTER TABLE outbox ADD COLUMN failures INTEGER NOT NULL DEFAULT 0")
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
            keep = [True] * len(rows)
            if need_n > 0 or need_b > 0:
                # new telemetry that would not fit even with all queued telemetry gone is dropped
                # first (newest first), so a record too large to ever fit costs nothing else
                old_n, old_b = conn.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM outbox "
                                            "WHERE kind = 'telemetry' AND state = 'queued'").fetchone()
                for i in reversed(range(len(rows))):
                    if need_n <= old_n and need_b <= old_b:
                        break
                    if rows[i][0].kind == Kind.TELEMETRY:
                        keep[i] = False
                        need_n, need_b = need_n - 1, need_b - rows[i][2]
                need_n, need_b = self._drop_telemetry(conn, need_n, need_b)
            # what still does not fit: drop the telemetry among the new items, newest first
            for i in reversed(range(len(rows))):
                if need_n <= 0 and need_b <= 0:
                    break
                if rows[i][0].kind == Kind.TELEMETRY and keep[i]:
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
                f"SELECT {COLUMNS} FROM outbox AS o WHERE kind = ? AND state = 'queued' "
                "AND next_attempt_at <= ? AND (session IS NULL OR NOT EXISTS ("
                f"  SELECT 1 FROM outbox AS p WHERE p.session = o.session AND p.seq < o.seq "
                f"  AND p.state IN {PENDING})) "
                "ORDER BY priority DESC, seq LIMIT ?", (Kind(kind).value, now, limit)).fetchall()
            items = [item_of(r) for r in rows]
            conn.executemany(
                "UPDATE outbox SET state = 'sending', lease_until = ?, attempts = attempts + 1, updated_at = ? "
                "WHERE seq = ?", [(lease_until, now, it.seq) for it in items])
        for it in items:
            it.state, it.attempts = State.SENDING.value, it.attempts + 1
        return items

    def complete(self, item_id: str, status: int, result: Any, failed: bool = False) -> None:
        """The cloud answered: ``done`` (or ``failed`` for a refusal) with its response in the inbox."""
        self.complete_many([(item_id, status, result, failed)])

    def complete_many(self, outcomes: Iterable[tuple]) -> None:
        """Settle items: ``(id, status, result, failed[, error])``. A done item's ``last_error`` is
        cleared (what it waited on is over); a failed one keeps ``error`` (else its last)."""
        now = self._clock()
        with self._write() as conn:
            for item_id, status, result, failed, *error in outcomes:
                state = State.FAILED if failed else State.DONE
                last_error = "" if not failed else (error[0][:500] if error and error[0] else None)
                changed = conn.execute(
                    f"UPDATE outbox SET state = ?, updated_at = ?, lease_until = 0, "
                    f"last_error = coalesce(?, last_error) WHERE id = ? AND state IN {PENDING}",
                    (state.value, now, last_error, item_id)).rowcount
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

    def retry_later(self, item_id: str, error: str, delay_s: float, failure: bool = False) -> None:
        """A delivery attempt failed for a passing reason: back to queued, due in ``delay_s``;
        ``failure``: a failure of the request's own, counted in ``failures``."""
        now = self._clock()
        with self._write() as conn:
            conn.execute("UPDATE outbox SET state = 'queued', next_attempt_at = ?, last_error = ?, lease_until = 0, "
                         "updated_at = ?, failures = failures + ? WHERE id = ? AND state = 'sending'",
                         (now + delay_s, error[:500], now, int(failure), item_id))

    def note_error(self, kind: Kind | str, error: str) -> int:
        """Record why the items of ``kind`` waiting now cannot go (the cloud refuses this device)
        without touching their state or attempts. Returns how many."""
        with self._write() as conn:
            return conn.execute("UPDATE outbox SET last_error = ? WHERE kind = ? AND state = 'queued'",
                                (error[:500], Kind(kind).value)).rowcount

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
                f"SELECT 1 FROM outbox WHERE session = ? AND state IN {PENDING} LIMIT 1", (session,)
            ).fetchone() is not None

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
                f"SELECT {O_COLUMNS}, i.status, i.result "
                "FROM inbox AS i JOIN outbox AS o ON o.id = i.id WHERE i.callback_state = 'pending' "
                "ORDER BY i.received_at LIMIT ?", (limit,)).fetchall()
        return [item_of(r, with_result=True) for r in rows]

    def callback_done(self, item_id: str, ok: bool) -> None:
        with self._write() as conn:
            conn.execute("UPDATE inbox SET callback_state = ? WHERE id = ?", ("done" if ok else "failed", item_id))
