"""The Batch API's durable state in SQLite (``sync.sqlite.SQLiteStore``: WAL, one writer, BEGIN
IMMEDIATE): a table of files (their bytes with them), one of batches, one of a batch's lines. A
line is ``pending`` -> ``running`` -> ``done`` (in the output file) or ``failed`` (in the error
file), and its result is written the moment it finishes, only while it is still ``running``: a
line ends exactly once, whatever else (a cancel, an expiry) happens at the same time. A gateway
that starts again puts its lines left ``running`` back to ``pending`` (``requeue_running``): they
run again, the finished ones never. Everything is looked up by tenant: another tenant's id is
not found."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path

from cloud_tier.gateway.batch_jsonl import InputLine, line_error, output_line, to_jsonl
from cloud_tier.gateway.batch_state import Status, check_transition
from sync.sqlite import SQLiteStore

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, id);
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
CREATE INDEX IF NOT EXISTS lines_by_status ON batch_lines (batch_id, status, idx);
"""
_FILE_FIELDS = "id, purpose, filename, bytes, created_at"
_OPEN = tuple(s.value for s in Status if not s.final)


def new_id(prefix: str) -> str:
    """Time-sortable (listings go newest first, ``after`` pages by id) and unguessable."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(6)}"


def file_object(row: dict) -> dict:
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "filename": row["filename"], "purpose": row["purpose"], "status": "processed", "status_details": None}


class BatchStore(SQLiteStore):
    def __init__(self, path: Path | str, clock=time.time):
        super().__init__(path)
        self.clock = clock
        with self._write() as conn:
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    conn.execute(statement)

    def _now(self) -> int:
        return int(self.clock())

    # -- files -------------------------------------------------------------------------------

    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes) -> dict:
        row = {"id": new_id("file-"), "tenant": tenant, "purpose": purpose, "filename": filename,
               "bytes": len(content), "created_at": self._now()}
        with self._write() as conn:
            conn.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, created_at, content) "
                         "VALUES (?, ?, ?, ?, ?, ?, ?)", (*row.values(), content))
        return file_object(row)

    def get_file(self, tenant: str, file_id: str) -> dict | None:
        rows = self._read(f"SELECT {_FILE_FIELDS} FROM files WHERE tenant = ? AND id = ?", (tenant, file_id))
        return file_object(rows[0]) if rows else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        rows = self._read("SELECT content FROM files WHERE tenant = ? AND id = ?", (tenant, file_id))
        return rows[0]["content"] if rows else None

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._write() as conn:
            return conn.execute("DELETE FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)).rowcount > 0

    def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int) -> tuple[list[dict], bool]:
        rows = self._read(f"SELECT {_FILE_FIELDS} FROM files WHERE tenant = ? AND (? IS NULL OR purpose = ?) "
                          "AND (? IS NULL OR id < ?) ORDER BY id DESC LIMIT ?",
                          (tenant, purpose, purpose, after, after, limit + 1))
        return [file_object(r) for r in rows[:limit]], len(rows) > limit

    # -- batches -----------------------------------------------------------------------------

    def create_batch(self, tenant: str, key_id: str, endpoint: str, input_file_id: str, window: str,
                     window_s: int, metadata: dict | None) -> str:
        now = self._now()
        batch_id = new_id("batch_")
        with self._write() as conn:
            conn.execute("INSERT INTO batches (id, tenant, key_id, endpoint, input_file_id, completion_window, "
                         "status, metadata, created_at, expires_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                         (batch_id, tenant, key_id, endpoint, input_file_id, window, Status.VALIDATING.value,
                          json.dumps(metadata) if metadata is not None else None, now, now + window_s))
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
        """Lines by status: pending, running, done, failed."""
        rows = self._read("SELECT status, COUNT(*) AS n FROM batch_lines WHERE batch_id = ? GROUP BY status",
                          (batch_id,))
        return {"pending": 0, "running": 0, "done": 0, "failed": 0, **{r["status"]: r["n"] for r in rows}}

    def _move(self, conn, batch_id: str, new: Status, **fields) -> None:
        (current,) = conn.execute("SELECT status FROM batches WHERE id = ?", (batch_id,)).fetchone()
        check_transition(Status(current), new)
        fields = {"status": new.value, new.timestamp_field: self._now(), **fields}
        sets = ", ".join(f"{k} = ?" for k in fields)
        conn.execute(f"UPDATE batches SET {sets} WHERE id = ?", (*fields.values(), batch_id))

    def start(self, batch_id: str, lines: list[InputLine]) -> None:
        """Validated: its lines stored (the unreadable ones failed at once), and in_progress."""
        with self._write() as conn:
            conn.executemany(
                "INSERT INTO batch_lines (batch_id, idx, custom_id, body, status, result) VALUES (?, ?, ?, ?, ?, ?)",
                [(batch_id, ln.index, ln.custom_id, json.dumps(ln.body) if ln.body is not None else None,
                  "pending" if ln.error is None else "failed",
                  None if ln.error is None else json.dumps(line_error(ln.custom_id, **ln.error)))
                 for ln in lines])
            self._move(conn, batch_id, Status.IN_PROGRESS)

    def fail(self, batch_id: str, errors: list[dict]) -> None:
        with self._write() as conn:
            self._move(conn, batch_id, Status.FAILED, errors=json.dumps({"object": "list", "data": errors}))

    def cancel(self, batch_id: str) -> None:
        """cancelling; its lines not started end as ``batch_cancelled`` (those running finish)."""
        with self._write() as conn:
            self._move(conn, batch_id, Status.CANCELLING)
            self._end_lines(conn, batch_id, ("pending",), "batch_cancelled", "The batch was cancelled before "
                            "this request started.")

    def expire(self, batch_id: str) -> None:
        """Its completion window passed: every unfinished line ends as ``batch_expired``, and the
        batch is expired with the files of what it has."""
        with self._write() as conn:
            self._end_lines(conn, batch_id, ("pending", "running"), "batch_expired",
                            "The batch's completion window ended before this request finished.")
            self._write_files(conn, batch_id, Status.EXPIRED)

    def finish(self, batch_id: str, status: Status) -> None:
        """finalizing -> completed, cancelling -> cancelled: the output and error files written, in
        one transaction with the status (a restart in between does it again, from the lines)."""
        with self._write() as conn:
            if status is Status.COMPLETED:
                self._move(conn, batch_id, Status.FINALIZING)
            self._write_files(conn, batch_id, status)

    def _end_lines(self, conn, batch_id: str, statuses: tuple[str, ...], code: str, message: str) -> None:
        marks = ", ".join("?" * len(statuses))
        rows = conn.execute(f"SELECT idx, custom_id FROM batch_lines WHERE batch_id = ? AND status IN ({marks})",
                            (batch_id, *statuses)).fetchall()
        conn.executemany("UPDATE batch_lines SET status = 'failed', result = ? WHERE batch_id = ? AND idx = ?",
                         [(json.dumps(line_error(cid, code, message)), batch_id, idx) for idx, cid in rows])

    def _write_files(self, conn, batch_id: str, status: Status) -> None:
        (tenant,) = conn.execute("SELECT tenant FROM batches WHERE id = ?", (batch_id,)).fetchone()
        ids = {}
        for line_status, field in (("done", "output_file_id"), ("failed", "error_file_id")):
            results = [json.loads(r) for (r,) in conn.execute(
                "SELECT result FROM batch_lines WHERE batch_id = ? AND status = ? ORDER BY idx",
                (batch_id, line_status))]
            if not results:
                continue
            content = to_jsonl(results)
            ids[field] = new_id("file-")
            conn.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, created_at, content) "
                         "VALUES (?, ?, 'batch_output', ?, ?, ?, ?)",
                         (ids[field], tenant, f"{batch_id}_{field.split('_')[0]}.jsonl", len(content), self._now(),
                          content))
        self._move(conn, batch_id, status, **ids)

    # -- lines -------------------------------------------------------------------------------

    def claim(self, batch_id: str, n: int) -> list[tuple[int, str | None, dict]]:
        """Up to ``n`` pending lines, in order, now running: (index, custom_id, body)."""
        with self._write() as conn:
            rows = conn.execute(
                "UPDATE batch_lines SET status = 'running' WHERE batch_id = ? AND idx IN (SELECT idx FROM batch_lines "
                "WHERE batch_id = ? AND status = 'pending' ORDER BY idx LIMIT ?) RETURNING idx, custom_id, body",
                (batch_id, batch_id, n)).fetchall()
        return sorted((idx, cid, json.loads(body)) for idx, cid, body in rows)

    def release(self, batch_id: str, index: int) -> None:
        """A running line back to pending (a refusal that passes: quota, capacity)."""
        with self._write() as conn:
            conn.execute("UPDATE batch_lines SET status = 'pending' WHERE batch_id = ? AND idx = ? AND "
                         "status = 'running'", (batch_id, index))

    def record(self, batch_id: str, index: int, custom_id: str | None, status_code: int, body: dict,
               request_id: str) -> bool:
        """A running line's answer: a 200 in the output file, anything else in the error file.
        False: the line had already ended (its batch expired meanwhile)."""
        line = output_line(custom_id, status_code, body, request_id)
        with self._write() as conn:
            return conn.execute(
                "UPDATE batch_lines SET status = ?, result = ? WHERE batch_id = ? AND idx = ? AND status = 'running'",
                ("done" if status_code == 200 else "failed", json.dumps(line), batch_id, index)).rowcount > 0

    def requeue_running(self) -> int:
        """At start-up: the lines a stopped gateway left running run again."""
        with self._write() as conn:
            return conn.execute("UPDATE batch_lines SET status = 'pending' WHERE status = 'running'").rowcount


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
