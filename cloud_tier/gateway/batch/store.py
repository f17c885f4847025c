"""The Batch API's durable state in SQLite (``sync.sqlite.SQLiteStore``: WAL, one writer, BEGIN
IMMEDIATE): the files (``batch.files``), a table of batches, one of a batch's lines. A line is
``pending`` -> ``running`` -> ``done`` (in the output file) or ``failed`` (in the error file), and
its result is written the moment it finishes, only while it is still ``running``: a line ends
exactly once, whatever else (a cancel, an expiry) happens at the same time. Only a batch in
progress has its lines claimed; a line that goes back (a refusal that passes, a gateway started
again: ``release``, ``requeue_running``) goes back to ``pending`` only while its batch is in
progress, and ends as ``batch_cancelled`` while it cancels: every line of a finished batch is in
exactly one of its files (done + failed == total), and once they are there its lines are deleted
(their counts kept on the batch). Everything is looked up by tenant: another tenant's id is not found.

What a batch stores counts against its tenant's storage cap (``stored_bytes``: the input file's
size from its creation, its lines' bytes once stored, nothing once its files are written), and a
tenant has at most ``max_active`` batches not yet ended. Lines are stored in transactions of at
most ``_START_LINES`` lines or ``_START_BYTES`` bytes, so the store's lock is never held for long;
the batch stays ``validating`` (its counts zero) until the last of them."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from pathlib import Path

from cloud_tier.gateway.batch.files import FileLimits, FileStore, StorageFull, file_object, new_id
from cloud_tier.gateway.batch.jsonl import InputLine, line_error, output_line
from cloud_tier.gateway.batch.state import InvalidTransition, Status, check_transition

__all__ = ["BatchStore", "TooManyBatches", "batch_object", "file_object", "new_id"]

_SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, key_id TEXT NOT NULL, endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, status TEXT NOT NULL, errors TEXT,
    output_file_id TEXT, error_file_id TEXT, metadata TEXT, created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL, in_progress_at INTEGER, finalizing_at INTEGER, completed_at INTEGER,
    failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, cancelled_at INTEGER);
CREATE INDEX IF NOT EXISTS batches_by_tenant ON batches (tenant, id);
CREATE TABLE IF NOT EXISTS batch_lines (
    batch_id TEXT NOT NULL, idx INTEGER NOT NULL, custom_id TEXT, body TEXT, status TEXT NOT NULL,
    result TEXT, PRIMARY KEY (batch_id, idx));
CREATE INDEX IF NOT EXISTS lines_by_status ON batch_lines (batch_id, status, idx)
"""
_ADDED = {"stored_bytes": "INTEGER NOT NULL DEFAULT 0", "n_done": "INTEGER", "n_failed": "INTEGER"}
_START_LINES, _START_BYTES = 2000, 8 << 20  # one transaction of a batch's lines stored at its start
_OPEN = tuple(s.value for s in Status if not s.final)
_CANCELLED = ("batch_cancelled", "The batch was cancelled before this request was answered.")


def _dump(obj) -> str:
    """A result as its line of an output file: compact, ASCII (no raw U+2028 for a reader to split on)."""
    return json.dumps(obj, separators=(",", ":"))


class TooManyBatches(Exception):
    """The tenant has its most batches not yet ended: the new one is refused."""


class BatchStore(FileStore):
    def __init__(self, path: Path | str, clock=time.time, limits: FileLimits = FileLimits()):
        super().__init__(path, clock, limits)
        self.created = asyncio.Event()  # set by the API when it creates a batch: the idle runner looks at once
        with self._write() as conn:
            for statement in _SCHEMA.split(";"):
                conn.execute(statement)
            have = {r[1] for r in conn.execute("PRAGMA table_info(batches)")}
            for column, kind in _ADDED.items():  # a store of before
                if column not in have:
                    conn.execute(f"ALTER TABLE batches ADD COLUMN {column} {kind}")

    def _used(self, conn, tenant: str, now: int) -> int:
        """Its files and what its batches store (their lines, or the size of the input file
        of a batch whose lines are not stored yet)."""
        (held,) = conn.execute("SELECT COALESCE(SUM(stored_bytes), 0) FROM batches WHERE tenant = ?",
                               (tenant,)).fetchone()
        return super()._used(conn, tenant, now) + held

    def active_batches(self, tenant: str) -> int:
        marks = ", ".join("?" * len(_OPEN))
        return self._read(f"SELECT COUNT(*) AS n FROM batches WHERE tenant = ? AND status IN ({marks})",
                          (tenant, *_OPEN))[0]["n"]

    # -- batches -----------------------------------------------------------------------------

    def create_batch(self, tenant: str, key_id: str, endpoint: str, input_file_id: str, window: str,
                     window_s: int, metadata: dict | None, max_active: int | None = None) -> str | None:
        """A new batch, validating (None: the input file is gone). It holds its input file's size
        of the tenant's storage until its lines are stored: StorageFull past the tenant's cap,
        TooManyBatches past ``max_active`` batches not yet ended (both counted in the insert's
        transaction)."""
        now = self._now()
        batch_id = new_id("batch_")
        marks = ", ".join("?" * len(_OPEN))
        with self._write() as conn:
            found = conn.execute("SELECT bytes FROM files WHERE tenant = ? AND id = ?", (tenant, input_file_id)
                                 ).fetchone()
            if found is None:
                return None
            (active,) = conn.execute(f"SELECT COUNT(*) FROM batches WHERE tenant = ? AND status IN ({marks})",
                                     (tenant, *_OPEN)).fetchone()
            if max_active is not None and active >= max_active:
                raise TooManyBatches(f"This tenant has {active} batches not yet ended, its limit; wait for one "
                                     "to end or cancel one.")
            used, cap = self._used(conn, tenant, now), self.limits.tenant_max_bytes
            if used + found[0] > cap:
                raise StorageFull(f"A batch stores its requests: this one would take the tenant's storage to "
                                  f"{used + found[0]} bytes, over its limit of {cap}; delete files to make room.")
            conn.execute("INSERT INTO batches (id, tenant, key_id, endpoint, input_file_id, completion_window, "
                         "status, metadata, created_at, expires_at, stored_bytes) VALUES (?, ?, ?, ?, ?, ?, ?, ?, "
                         "?, ?, ?)", (batch_id, tenant, key_id, endpoint, input_file_id, window,
                                      Status.VALIDATING.value, json.dumps(metadata) if metadata is not None else None,
                                      now, now + window_s, found[0]))
        return batch_id

    def batch(self, batch_id: str, tenant: str | None = None) -> dict | None:
        rows = self._read("SELECT * FROM batches WHERE id = ? AND (? IS NULL OR tenant = ?)",
                          (batch_id, tenant, tenant))
        return rows[0] if rows else None

    def list_batches(self, tenant: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        rows = self._read("SELECT * FROM batches WHERE tenant = ? AND (? IS NULL OR id < ?) ORDER BY id DESC "
                          "LIMIT ?", (tenant, after, after, limit + 1))
        return rows[:limit], len(rows) > limit

    def open_batches(self) -> list[dict]:
        """The batches not yet in a final state, oldest first."""
        marks = ", ".join("?" * len(_OPEN))
        return self._read(f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY id", _OPEN)

    def counts(self, batch_id: str) -> dict[str, int]:
        """Lines by status: pending, running, done, failed (none while the batch validates; those
        its files hold once they are written)."""
        counts = {"pending": 0, "running": 0, "done": 0, "failed": 0}
        row = self._read("SELECT status, n_done, n_failed FROM batches WHERE id = ?", (batch_id,))
        if not row or row[0]["status"] == Status.VALIDATING.value:
            return counts
        if row[0]["n_done"] is not None:
            return {**counts, "done": row[0]["n_done"], "failed": row[0]["n_failed"]}
        rows = self._read("SELECT status, COUNT(*) AS n FROM batch_lines WHERE batch_id = ? GROUP BY status",
                          (batch_id,))
        return {**counts, **{r["status"]: r["n"] for r in rows}}

    def _move(self, conn, batch_id: str, new: Status, **fields) -> None:
        (current,) = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        check_transition(Status(current), new)
        fields = {"status": new.value, new.timestamp_field: self._now(), **fields}
        sets = ", ".join(f"{k} = ?" for k in fields)
        conn.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*fields.values(), batch_id))

    def start(self, batch_id: str, lines: Iterable[InputLine]) -> None:
        """Validated: its lines stored (the unreadable ones failed at once), then in_progress with
        what they take as its ``stored_bytes``. ``lines`` may be a generator over the input file:
        they are read outside the lock and stored a transaction of ``_START_LINES`` at a time.
        InvalidTransition: the batch was cancelled (or expired) meanwhile; what is stored stays
        for its files."""
        rows, size, total, first = [], 0, 0, True
        for ln in lines:
            body = None if ln.body is None else json.dumps(ln.body, ensure_ascii=False, separators=(",", ":"))
            result = None if ln.error is None else _dump(line_error(ln.custom_id, **ln.error))
            rows.append((batch_id, ln.index, ln.custom_id, body, "pending" if ln.error is None else "failed", result))
            size += len((body or result).encode()) + len((ln.custom_id or "").encode())
            if len(rows) >= _START_LINES or size - total >= _START_BYTES:
                self._store_lines(batch_id, rows, first)
                rows, total, first = [], size, False
        self._store_lines(batch_id, rows, first, done=size)

    def _store_lines(self, batch_id: str, rows: list[tuple], first: bool, done: int | None = None) -> None:
        with self._write() as conn:
            (status,) = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if status != Status.VALIDATING.value:
                raise InvalidTransition(f"batch {batch_id} is {status}: its lines are not stored")
            if first:  # a start cut short by a stop: it starts over
                conn.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            conn.executemany("INSERT INTO batch_lines (batch_id, idx, custom_id, body, status, result) "
                             "VALUES (?, ?, ?, ?, ?, ?)", rows)
            if done is not None:
                self._move(conn, batch_id, Status.IN_PROGRESS, stored_bytes=done)

    def fail(self, batch_id: str, errors: list[dict]) -> None:
        with self._write() as conn:
            conn.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))
            self._move(conn, batch_id, Status.FAILED, errors=json.dumps({"object": "list", "data": errors}),
                       n_done=0, n_failed=0, stored_bytes=0)

    def cancel(self, batch_id: str) -> None:
        """cancelling; its lines not started end as ``batch_cancelled`` (those running finish)."""
        with self._write() as conn:
            self._move(conn, batch_id, Status.CANCELLING)
            self._end_lines(conn, batch_id, ("pending",), *_CANCELLED)

    def expire(self, batch_id: str) -> None:
        """Its completion window passed: every unfinished line ends as ``batch_expired``, and the
        batch is expired with the files of what it has."""
        with self._write() as conn:
            self._end_lines(conn, batch_id, ("pending", "running"), "batch_expired",
                            "The batch's completion window ended before this request finished.")
            self._write_files(conn, batch_id, Status.EXPIRED)
        self.reclaim()

    def finish(self, batch_id: str, status: Status) -> None:
        """finalizing -> completed, cancelling -> cancelled: the output and error files written, in
        one transaction with the status (a restart in between does it again, from the lines). A
        line a cancelled batch still has unfinished ends as ``batch_cancelled``."""
        with self._write() as conn:
            if status is Status.COMPLETED:
                self._move(conn, batch_id, Status.FINALIZING)
            else:
                self._end_lines(conn, batch_id, ("pending", "running"), *_CANCELLED)
            self._write_files(conn, batch_id, status)
        self.reclaim()

    def _end_lines(self, conn, batch_id: str, statuses: tuple[str, ...], code: str, message: str,
                   index: int | None = None) -> int:
        marks = ", ".join("?" * len(statuses))
        rows = conn.execute(f"SELECT idx, custom_id FROM batch_lines WHERE batch_id = ? AND status IN ({marks}) "
                            "AND (? IS NULL OR idx = ?)", (batch_id, *statuses, index, index)).fetchall()
        results = [(_dump(line_error(cid, code, message)), batch_id, idx) for idx, cid in rows]
        conn.executemany("UPDATE batch_lines SET status = 'failed', result = ? WHERE batch_id = ? AND idx = ?", results)
        conn.execute("UPDATE batches SET stored_bytes = stored_bytes + ? WHERE id = ?",
                     (sum(len(r[0]) for r in results), batch_id))
        return len(rows)

    def _write_files(self, conn, batch_id: str, status: Status) -> None:
        """The output and error files, streamed from the lines' results into their BLOBs (a batch's
        results are never held whole); then the batch's new status. Every line has ended."""
        (tenant,) = conn.execute("SELECT tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()
        (unfinished,) = conn.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND status IN "
                                     "('pending', 'running')", (batch_id,)).fetchone()
        if unfinished:
            raise RuntimeError(f"batch {batch_id} has {unfinished} unfinished lines: its files would lose them")
        ids, n = {}, {}
        for line_status, field in (("done", "output_file_id"), ("failed", "error_file_id")):
            (n[line_status],) = conn.execute("SELECT COUNT(*) FROM batch_lines WHERE batch_id = ? AND status = ?",
                                             (batch_id, line_status)).fetchone()
            (size,) = conn.execute("SELECT SUM(length(CAST(result AS BLOB)) + 1) FROM batch_lines WHERE batch_id = ? "
                                   "AND status = ?", (batch_id, line_status)).fetchone()
            if not size:
                continue
            rows = conn.execute("SELECT result FROM batch_lines WHERE batch_id = ? AND status = ? ORDER BY idx",
                                (batch_id, line_status))
            ids[field] = self.insert_file(conn, tenant, "batch_output", f"{batch_id}_{field.split('_')[0]}.jsonl",
                                          (r.encode() + b"\n" for (r,) in rows), size)["id"]
        conn.execute("DELETE FROM batch_lines WHERE batch_id = ?", (batch_id,))  # the files hold them now
        self._move(conn, batch_id, status, **ids, n_done=n["done"], n_failed=n["failed"], stored_bytes=0)

    # -- lines -------------------------------------------------------------------------------

    def claim(self, batch_id: str, n: int) -> list[tuple[int, str | None, dict]]:
        """Up to ``n`` pending lines of a batch in progress, in order, now running: (index,
        custom_id, body)."""
        with self._write() as conn:
            rows = conn.execute(
                "UPDATE batch_lines SET status = 'running' WHERE batch_id = ? AND idx IN (SELECT idx FROM batch_lines "
                "WHERE batch_id = ? AND status = 'pending' AND (SELECT status FROM batches WHERE id = ?) = ? "
                "ORDER BY idx LIMIT ?) RETURNING idx, custom_id, body",
                (batch_id, batch_id, batch_id, Status.IN_PROGRESS.value, n)).fetchall()
        return sorted((idx, cid, json.loads(body)) for idx, cid, body in rows)

    def release(self, batch_id: str, index: int) -> str | None:
        """A running line not answered (a refusal that passes, a failure of ours): back to pending
        while its batch is in progress, ``batch_cancelled`` while it cancels. Its new status (None:
        it was not running, as a line whose batch expired meanwhile)."""
        with self._write() as conn:
            row = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
            if row is not None and row[0] == Status.IN_PROGRESS.value:
                moved = conn.execute("UPDATE batch_lines SET status = 'pending' WHERE batch_id = ? AND idx = ? AND "
                                     "status = 'running'", (batch_id, index)).rowcount
                return "pending" if moved else None
            return "failed" if self._end_lines(conn, batch_id, ("running",), *_CANCELLED, index=index) else None

    def record(self, batch_id: str, index: int, custom_id: str | None, status_code: int, body: dict,
               request_id: str) -> bool:
        """A running line's answer: a 200 in the output file, anything else in the error file.
        False: the line had already ended (its batch expired meanwhile)."""
        result = _dump(output_line(custom_id, status_code, body, request_id))
        with self._write() as conn:
            if not conn.execute("UPDATE batch_lines SET status = ?, result = ? WHERE batch_id = ? AND idx = ? AND "
                                "status = 'running'", ("done" if status_code == 200 else "failed", result, batch_id,
                                                       index)).rowcount:
                return False
            conn.execute("UPDATE batches SET stored_bytes = stored_bytes + ? WHERE id = ?", (len(result), batch_id))
            return True

    def requeue_running(self) -> int:
        """At start-up: the lines a stopped gateway left running run again (those of a batch that
        was cancelling end as ``batch_cancelled``). How many lines it moved."""
        with self._write() as conn:
            moved = conn.execute("UPDATE batch_lines SET status = 'pending' WHERE status = 'running' AND batch_id IN "
                                 "(SELECT id FROM batches WHERE status = ?)", (Status.IN_PROGRESS.value,)).rowcount
            for (batch_id,) in conn.execute("SELECT DISTINCT batch_id FROM batch_lines WHERE status = 'running'"
                                            ).fetchall():
                moved += self._end_lines(conn, batch_id, ("running",), *_CANCELLED)
            return moved


def batch_object(row: dict, counts: dict[str, int]) -> dict:
    """A ``batches`` row as OpenAI's Batch object."""
    stamps = ("created_at", "in_progress_at", "expires_at", "finalizing_at", "completed_at", "failed_at",
              "expired_at", "cancelling_at", "cancelled_at")
    return {"id": row["id"], "object": "batch", "endpoint": row["endpoint"],
            "errors": json.loads(row["errors"]) if row["errors"] else None,
            "input_file_id": row["input_file_id"], "completion_window": row["completion_window"],
            "status": row["status"], "output_file_id": row["output_file_id"], "error_file_id": row["error_file_id"],
            **{k: row[k] for k in stamps},
            "request_counts": {"total": sum(counts.values()), "completed": counts["done"],
                               "failed": counts["failed"]},
            "metadata": json.loads(row["metadata"]) if row["metadata"] else None}
