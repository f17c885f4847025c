"""sync/sqlite.py's helpers, which every SQLite store opens and writes through (the offline queue,
the keys and idempotency stores, the fleet's registry, devices and rollouts)."""

from __future__ import annotations

import pytest

from sync.sqlite import connect, transaction


def test_a_connection_is_wal_with_no_implicit_transaction_and_the_synchronous_asked_for(tmp_path):
    db = connect(tmp_path / "a.db", synchronous="NORMAL")
    assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)
    assert db.execute("PRAGMA synchronous").fetchone() == (1,)  # NORMAL
    assert db.isolation_level is None and not db.in_transaction
    db.close()


def test_a_transaction_commits_at_its_end_and_rolls_back_what_raised(tmp_path):
    db = connect(tmp_path / "a.db")
    db.execute("CREATE TABLE t (x INTEGER)")
    with transaction(db) as tx:
        tx.execute("INSERT INTO t VALUES (1)")
    with pytest.raises(RuntimeError), transaction(db, immediate=False) as tx:
        tx.execute("INSERT INTO t VALUES (2)")
        raise RuntimeError("a failed batch")
    assert not db.in_transaction
    other = connect(tmp_path / "a.db")  # another connection (process) sees what was committed, only that
    assert other.execute("SELECT x FROM t").fetchall() == [(1,)]
    db.close()
    other.close()


def test_an_immediate_transaction_takes_the_write_lock_at_once(tmp_path):
    a, b = connect(tmp_path / "a.db"), connect(tmp_path / "a.db", timeout_s=0.05)
    a.execute("CREATE TABLE t (x INTEGER)")
    with transaction(a):
        with pytest.raises(Exception, match="locked"), transaction(b):
            pass
    with transaction(b) as tx:  # free again once the first committed
        tx.execute("INSERT INTO t VALUES (1)")
    a.close()
    b.close()
