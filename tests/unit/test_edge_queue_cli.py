"""`cascade edge queue` (cascade_cli/edge_queue.py), in process: its numbers are bounded by argparse
(issue 37 item 3) and a delivered item shows no error it once waited on (item 4)."""

from __future__ import annotations

import json

import pytest

from cascade_cli.main import main
from sync.queue import Kind, OfflineQueue


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    for name in ("CASCADE_EDGE_SYNC_PATH",):
        monkeypatch.delenv(name, raising=False)
    q = OfflineQueue(tmp_path / "edge" / "queue.db", synchronous="NORMAL")
    done = q.enqueue(Kind.REQUEST, {"q": "delivered"}, endpoint="chat")
    waiting = q.enqueue(Kind.REQUEST, {"q": "waiting"}, endpoint="chat")
    q.claim(Kind.REQUEST, 1)
    q.note_error(Kind.REQUEST, "HTTP 503 the cloud is away")
    # a file from before the fix: a done item that kept the error it waited on
    q.complete(done, 200, {"choices": []})
    with q._write() as conn:
        conn.execute("UPDATE outbox SET last_error = 'HTTP 503 stale' WHERE id = ?", (done,))
    q.close()
    return {"done": done, "waiting": waiting}


@pytest.mark.parametrize("limit", ["99999999999999999999", "-1", "0", "1000001", "ten", "1e3"])
def test_an_out_of_range_limit_is_one_line_and_exit_2(home, capsys, limit):
    with pytest.raises(SystemExit) as e:
        main(["edge", "queue", "list", "--limit", limit])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "argument --limit:" in err.strip().split("\n")[-1]


def test_a_limit_in_range_lists(home, capsys):
    assert main(["edge", "queue", "list", "--limit", "1"]) == 0
    out = capsys.readouterr().out
    assert home["done"] in out and home["waiting"] not in out


def test_a_done_item_shows_no_stale_error_and_a_waiting_one_shows_its_own(home, capsys):
    assert main(["edge", "queue", "list"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[1:]}
    assert "HTTP 503" not in lines[home["done"]] and "HTTP 503" in lines[home["waiting"]]
    assert main(["edge", "queue", "list", "--json"]) == 0
    listed = {it["id"]: it for it in json.loads(capsys.readouterr().out)}
    assert listed[home["done"]]["last_error"] is None
    assert listed[home["waiting"]]["last_error"].startswith("HTTP 503")
