"""Closing the Batch API's file store while another thread reads through it (the gateway shuts
down while a request's query runs in the thread pool): the query finishes, later reads get a
clear error, and the process lives. Closing a connection under a running query crashed the
whole test run once (a segfault in ``FileStore._read``): the race runs in a child process."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from cloud_tier.gateway.batch.files import FileStore

_RACE = textwrap.dedent("""
    import sqlite3, sys, threading, time
    from cloud_tier.gateway.batch.files import FileStore
    store = FileStore(sys.argv[1])
    store._read("SELECT 1")  # this thread's reader exists before the close
    out, started = [], threading.Event()
    def long_read():
        started.set()
        out.append(store._read("WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c WHERE x < 5000000) "
                               "SELECT COUNT(*) AS n FROM c"))
    reader = threading.Thread(target=long_read)
    reader.start()
    started.wait()
    time.sleep(0.2)
    store.close()
    reader.join()
    assert out == [[{"n": 5000000}]], out
    try:
        store._read("SELECT 1")
    except sqlite3.ProgrammingError:
        pass
    else:
        raise AssertionError("a read after close() succeeded")
    print("lived")
""")


def test_closing_under_a_running_read_waits_for_it(tmp_path):
    child = subprocess.run([sys.executable, "-c", _RACE, str(tmp_path / "files.db")], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == 0, f"rc {child.returncode}: {child.stderr[-2000:]}"
    assert child.stdout.strip() == "lived"


def test_a_new_thread_cannot_read_a_closed_store(tmp_path):
    store = FileStore(tmp_path / "files.db")
    store.close()
    with pytest.raises(Exception, match="closed"):
        store._read("SELECT 1")
