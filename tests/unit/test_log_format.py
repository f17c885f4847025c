"""The agent's log lines (edge_agent/daemon.py): JSON objects, or plain lines for the journal."""

from __future__ import annotations

import io
import json
import logging
import os

from edge_agent.daemon import JournalFormatter, JSONFormatter, under_journal


def record(msg="queued %s", args=("r1",), level=logging.WARNING, **extra) -> logging.LogRecord:
    r = logging.LogRecord("edge_agent.server.outbox", level, __file__, 1, msg, args, None)
    r.__dict__.update(extra)
    return r


def test_json_lines_carry_ts_level_logger_msg_and_extra_fields():
    out = json.loads(JSONFormatter().format(record(item="r1", attempts=2)))
    assert out["level"] == "WARNING" and out["logger"] == "edge_agent.server.outbox" and out["msg"] == "queued r1"
    assert out["item"] == "r1" and out["attempts"] == 2 and out["ts"].endswith("+00:00")
    assert set(out) == {"ts", "level", "logger", "msg", "item", "attempts"}


def test_a_json_line_holds_the_traceback_in_one_line():
    try:
        raise ValueError("bad")
    except ValueError:
        import sys

        r = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", (), sys.exc_info())
    line = JSONFormatter().format(r)
    assert "\n" not in line and "ValueError: bad" in json.loads(line)["exc"]


def test_journal_lines_have_a_priority_prefix_and_no_timestamp():
    assert JournalFormatter().format(record(level=logging.ERROR)) == "<3>edge_agent.server.outbox: queued r1"
    assert JournalFormatter().format(record(level=logging.INFO)).startswith("<6>")


def test_the_journal_is_recognised_by_the_device_and_inode_of_stdout(tmp_path):
    with open(tmp_path / "out", "w") as f:
        st = os.fstat(f.fileno())
        assert under_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino}"}, f)
        assert not under_journal({"JOURNAL_STREAM": f"{st.st_dev}:{st.st_ino + 1}"}, f)  # inherited, not ours
        assert not under_journal({}, f)
    assert not under_journal({"JOURNAL_STREAM": "1:2"}, io.StringIO())
