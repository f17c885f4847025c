"""The Batch API's stored files in SQLite: uploads and batch outputs, their bytes in a BLOB that is
written and read a chunk at a time (never held whole: ``open_content`` reads through a connection
of its own, so a long read holds no lock of the store). Each tenant has a cap on the bytes and on
the number of its files (``FileLimits``; an upload past either is ``StorageFull``), and a file
expires (OpenAI's ``expires_after``, else ``ttl_s`` after its creation): an expired file is not
found at once and ``sweep_expired`` deletes it. Everything is looked up by tenant.

Reads go through read-only connections of their own (one per thread: WAL readers never wait for
the writer), so a long write holds no reader up; and the database gives back the space of what
is deleted (incremental auto-vacuum, the WAL truncated: ``reclaim``)."""

from __future__ import annotations

import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from sync.sqlite import SQLiteStore

log = logging.getLogger(__name__)
CHUNK = 1 << 20
_WAL_LIMIT = 8 << 20  # the WAL file is cut back to this after a checkpoint
_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, content BLOB NOT NULL, expires_at INTEGER);
CREATE INDEX IF NOT EXISTS files_by_tenant ON files (tenant, id)
"""
_FIELDS = "id, purpose, filename, bytes, created_at, expires_at"
_LIVE = "(expires_at IS NULL OR expires_at > ?)"


@dataclass(frozen=True)
class FileLimits:
    tenant_max_bytes: int = 1 << 30
    tenant_max_files: int = 1000
    ttl_s: int = 30 * 86400  # after its creation a file expires (0: kept until deleted)


class StorageFull(Exception):
    """The tenant's files are at its cap: the upload is refused (the message says which cap)."""


def file_object(row: dict) -> dict:
    """A ``files`` row as OpenAI's File object."""
    return {"id": row["id"], "object": "file", "bytes": row["bytes"], "created_at": row["created_at"],
            "expires_at": row["expires_at"], "filename": row["filename"], "purpose": row["purpose"],
            "status": "processed", "status_details": None}


def new_id(prefix: str) -> str:
    """Time-sortable (listings go newest first, ``after`` pages by id) and unguessable."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(6)}"


@dataclass(frozen=True)
class _Reader:
    conn: sqlite3.Connection
    lock: threading.Lock


class FileStore(SQLiteStore):
    def __init__(self, path: Path | str, clock=time.time, limits: FileLimits = FileLimits()):
        super().__init__(path)
        self.path = Path(path)
        self.clock = clock
        self.limits = limits
        self._readers: list[_Reader] = []
        self._local = threading.local()
        self._closed = False
        with self._lock:
            conn = self._db.conn
            conn.execute(f"PRAGMA journal_size_limit = {_WAL_LIMIT}")
            if conn.execute("PRAGMA auto_vacuum").fetchone()[0] != 2:  # a new file, or one of before: once
                if conn.execute("SELECT COUNT(*) FROM sqlite_master").fetchone()[0]:
                    log.info("converting %s to incremental auto-vacuum (once)", self.path)
                conn.execute("PRAGMA auto_vacuum = INCREMENTAL")
                try:
                    conn.execute("VACUUM")
                except sqlite3.OperationalError as e:  # another process reads it now: the next start converts it
                    log.warning("%s keeps its deleted space until a later start: %s", self.path, e)
        with self._write() as conn:
            for statement in _SCHEMA.split(";"):
                conn.execute(statement)
            if "expires_at" not in {r[1] for r in conn.execute("PRAGMA table_info(files)")}:  # a store of before
                conn.execute("ALTER TABLE files ADD COLUMN expires_at INTEGER")
            conn.execute("CREATE INDEX IF NOT EXISTS files_by_expiry ON files (expires_at)")

    def _now(self) -> int:
        return int(self.clock())

    def close(self) -> None:
        """Close the store: each reader waits for the query it runs (closing a connection under a
        running query crashes the process), and a read after this raises ProgrammingError."""
        with self._lock:
            self._closed = True
            readers, self._readers = self._readers, []
        for reader in readers:
            with reader.lock:
                reader.conn.close()
        super().close()

    def _read(self, sql: str, params=()) -> list[dict]:
        """The rows of one query, through this thread's read-only connection (no lock of the store)."""
        reader = getattr(self._local, "reader", None)
        if reader is None:
            with self._lock:
                if self._closed:
                    raise sqlite3.ProgrammingError(f"the store {self.path} is closed")
                conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0,
                                       check_same_thread=False)
                conn.row_factory = sqlite3.Row
                reader = self._local.reader = _Reader(conn, threading.Lock())
                self._readers.append(reader)
        with reader.lock:  # close() takes it: the connection is never closed under this query
            return [dict(row) for row in reader.conn.execute(sql, params)]

    def reclaim(self) -> None:
        """Give the space of deleted rows back to the file system: the free pages cut off the
        database's end, the WAL checkpointed and truncated (skipped while a reader needs it)."""
        with self._lock:
            self._db.conn.executescript("PRAGMA incremental_vacuum;")
            self._db.conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()

    def _used(self, conn: sqlite3.Connection, tenant: str, now: int) -> int:
        """The bytes a tenant stores, as its cap counts them (here: its live files)."""
        return conn.execute(f"SELECT COALESCE(SUM(bytes), 0) FROM files WHERE tenant = ? AND {_LIVE}",
                            (tenant, now)).fetchone()[0]

    def used_bytes(self, tenant: str) -> int:
        """The bytes a tenant stores, as its cap counts them."""
        with self._lock:
            return self._used(self._db.conn, tenant, self._now())

    def add_file(self, tenant: str, purpose: str, filename: str, content: bytes | Iterable[bytes],
                 size: int | None = None, expires_after_s: int | None = None) -> dict:
        """Store an upload of ``size`` bytes (``content``: bytes, or chunks adding up to ``size``),
        expiring ``expires_after_s`` (else the configured TTL) after now; StorageFull past the
        tenant's caps (counted with the upload, in the same transaction as the insert)."""
        size = len(content) if isinstance(content, bytes | bytearray) else size
        now, cap = self._now(), self.limits
        with self._write() as conn:
            (count,) = conn.execute(f"SELECT COUNT(*) FROM files WHERE tenant = ? AND {_LIVE}",
                                    (tenant, now)).fetchone()
            used = self._used(conn, tenant, now)
            if count >= cap.tenant_max_files:
                raise StorageFull(f"This tenant has {count} stored files, its limit; delete some to upload more.")
            if used + size > cap.tenant_max_bytes:
                raise StorageFull(f"This file would take the tenant's stored files to {used + size} bytes, over "
                                  f"its limit of {cap.tenant_max_bytes}; delete some to upload more.")
            return self.insert_file(conn, tenant, purpose, filename, content, size, expires_after_s)

    def insert_file(self, conn: sqlite3.Connection, tenant: str, purpose: str, filename: str,
                    content: bytes | Iterable[bytes], size: int, expires_after_s: int | None = None) -> dict:
        """Insert a file in the caller's write transaction, its content written in chunks."""
        now = self._now()
        ttl = self.limits.ttl_s if expires_after_s is None else expires_after_s
        row = {"id": new_id("file-"), "tenant": tenant, "purpose": purpose, "filename": filename, "bytes": size,
               "created_at": now, "expires_at": now + ttl if ttl else None}
        cursor = conn.execute("INSERT INTO files (id, tenant, purpose, filename, bytes, created_at, expires_at, "
                              "content) VALUES (?, ?, ?, ?, ?, ?, ?, zeroblob(?))", (*row.values(), size))
        with conn.blobopen("files", "content", cursor.lastrowid) as blob:
            written = 0
            for piece in ([content] if isinstance(content, bytes | bytearray) else _coalesce(content)):
                if written + len(piece) > size:
                    raise ValueError("the content is longer than its size")
                blob.write(piece)
                written += len(piece)
        if written != size:
            raise ValueError(f"the content is {written} bytes, not {size}")
        return file_object(row)

    def get_file(self, tenant: str, file_id: str) -> dict | None:
        rows = self._read(f"SELECT {_FIELDS} FROM files WHERE tenant = ? AND id = ? AND {_LIVE}",
                          (tenant, file_id, self._now()))
        return file_object(rows[0]) if rows else None

    def file_content(self, tenant: str, file_id: str) -> bytes | None:
        """A file's bytes, whole: for small files (tests); the gateway streams ``open_content``."""
        with self.open_content(tenant, file_id) as chunks:
            return None if chunks is None else b"".join(chunks)

    @contextmanager
    def open_content(self, tenant: str, file_id: str, chunk: int = CHUNK) -> Iterator[Iterator[bytes] | None]:
        """A file's bytes as chunks of up to ``chunk`` bytes (None: not found), read through a
        read-only connection of its own: the store's lock is not held while they are read."""
        conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0,
                               check_same_thread=False)
        try:
            found = conn.execute(f"SELECT rowid FROM files WHERE tenant = ? AND id = ? AND {_LIVE}",
                                 (tenant, file_id, self._now())).fetchone()
            if found is None:
                yield None
                return
            with conn.blobopen("files", "content", found[0], readonly=True) as blob:
                yield iter(lambda: blob.read(chunk), b"")
        finally:
            conn.close()

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._write() as conn:
            deleted = conn.execute("DELETE FROM files WHERE tenant = ? AND id = ?", (tenant, file_id)).rowcount > 0
        self.reclaim()
        return deleted

    def list_files(self, tenant: str, purpose: str | None, after: str | None, limit: int) -> tuple[list[dict], bool]:
        rows = self._read(f"SELECT {_FIELDS} FROM files WHERE tenant = ? AND (? IS NULL OR purpose = ?) "
                          f"AND (? IS NULL OR id < ?) AND {_LIVE} ORDER BY id DESC LIMIT ?",
                          (tenant, purpose, purpose, after, after, self._now(), limit + 1))
        return [file_object(r) for r in rows[:limit]], len(rows) > limit

    def sweep_expired(self) -> int:
        """Delete the files whose time has come; how many."""
        with self._write() as conn:
            swept = conn.execute("DELETE FROM files WHERE expires_at IS NOT NULL AND expires_at <= ?",
                                 (self._now(),)).rowcount
        if swept:
            self.reclaim()
        return swept


def _coalesce(chunks: Iterable[bytes]) -> Iterator[bytes]:
    """Small pieces gathered into writes of about CHUNK bytes."""
    buffer = bytearray()
    for piece in chunks:
        buffer += piece
        if len(buffer) >= CHUNK:
            yield bytes(buffer)
            buffer.clear()
    if buffer:
        yield bytes(buffer)
