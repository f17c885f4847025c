"""Throwaway PostgreSQL and Redis servers on loopback, each on a free port with its data in a
temporary directory and durability off: what the tests (tests/pg_redis.py, the fixtures
``postgres_dsn`` and ``redis_url``) and the benchmarks (bench/gateway_overhead.py) run the
gateway's shared state on. A missing server binary is ``MissingServer`` naming what to install.
Never for data that must outlive the process that started them."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
import uuid

from cascade.processes import free_port, stop

PG_USER = "postgres"  # initdb refuses root: the server runs as this unprivileged user when we are root


class MissingServer(RuntimeError):
    """A server binary (or the user to run it as) is not installed here."""


def _pg_bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(p.split("/")[4]))
    path = found[-1] if found else shutil.which(name)
    if path is None:
        raise MissingServer(f"PostgreSQL's {name} is not installed (apt-get install postgresql)")
    return path


def _wait(ready, proc: subprocess.Popen, what: str, log: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None or time.monotonic() > deadline:
            with open(log, errors="replace") as f:
                tail = f.read()[-2000:]
            stop(proc)
            raise RuntimeError(f"{what} did not start (exit status {proc.poll()}):\n{tail}")
        time.sleep(0.1)


class Postgres:
    """``initdb`` + ``postgres`` in a temporary directory; ``dsn`` is the superuser's on the
    ``postgres`` database. Durability is off (fsync): nothing here outlives the session."""

    def __init__(self):
        initdb, postgres = _pg_bin("initdb"), _pg_bin("postgres")
        user = {}
        if os.geteuid() == 0:
            try:
                pw = pwd.getpwnam(PG_USER)
            except KeyError:
                raise MissingServer(f"no user {PG_USER!r} to run PostgreSQL as (initdb refuses root; "
                                    "apt-get install postgresql creates it)") from None
            user = {"user": pw.pw_uid, "group": pw.pw_gid}
        self.dir = tempfile.mkdtemp(prefix="cascade-pg-")  # not under pytest's root-only tmp dirs
        if user:
            os.chown(self.dir, user["user"], user["group"])
        data, self.log = os.path.join(self.dir, "data"), os.path.join(self.dir, "postgres.log")
        subprocess.run([initdb, "-D", data, "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync"],
                       check=True, capture_output=True, **user)
        self.port = free_port()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [postgres, "-D", data, "-p", str(self.port), "-k", self.dir, "-c", "listen_addresses=127.0.0.1",
                 "-c", "fsync=off", "-c", "synchronous_commit=off", "-c", "full_page_writes=off",
                 "-c", "max_connections=200"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **user)
        self.dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        _wait(self._ready, self.proc, "PostgreSQL", self.log)

    def _ready(self) -> bool:
        import psycopg

        try:
            psycopg.connect(self.dsn, connect_timeout=2).close()
            return True
        except psycopg.OperationalError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)  # fast shutdown: do not wait for clients to leave
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=20)
        stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)


def fresh_database(dsn: str) -> str:
    """A new, empty database on the server of ``dsn``: its DSN (a test's own, so tests never see
    each other's rows)."""
    import psycopg

    name = f"t_{uuid.uuid4().hex[:16]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return dsn.rsplit("/", 1)[0] + f"/{name}"


class Redis:
    """``redis-server`` with persistence off, its files in a temporary directory."""

    def __init__(self):
        binary = shutil.which("redis-server") or ("/usr/bin/redis-server" if os.path.exists(
            "/usr/bin/redis-server") else None)
        if binary is None:
            raise MissingServer("redis-server is not installed (apt-get install redis-server)")
        self.dir = tempfile.mkdtemp(prefix="cascade-redis-")
        self.log = os.path.join(self.dir, "redis.log")
        self.port = free_port()
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                 "--dir", self.dir], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        _wait(self._ready, self.proc, "Redis", self.log)

    def _ready(self) -> bool:
        import redis

        try:
            return bool(redis.Redis.from_url(self.url, socket_timeout=2).ping())
        except redis.ConnectionError:
            return False

    def stop(self) -> None:
        stop(self.proc)
        shutil.rmtree(self.dir, ignore_errors=True)
