"""Every line of a finished batch is in exactly one of its files, whatever happened while it
cancelled (a line refused and put back, a gateway killed and started again on the same
database); the input file is read a line at a time, split on b"\\n" only."""

from __future__ import annotations

import json
import random

from cloud_tier.gateway.batch.jsonl import TooLong, count_lines, raw_lines, validate
from cloud_tier.gateway.batch.state import Status
from cloud_tier.gateway.batch.store import BatchStore, batch_object

CHAT = "/v1/chat/completions"


def started(path, n=6):
    store = BatchStore(path)
    content = "".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": {}}) + "\n"
                      for i in range(n)).encode()
    f = store.add_file("acme", "batch", "in.jsonl", content)
    bid = store.create_batch("acme", "k1", CHAT, f["id"], "24h", 86400, None)
    store.start(bid, validate(content, CHAT, 100).lines)
    return store, bid


def every_line_once(store, bid, n) -> dict:
    b = batch_object(store.batch(bid), store.counts(bid))
    found = []
    for field in ("output_file_id", "error_file_id"):
        if b[field]:
            found += [json.loads(x)["custom_id"] for x in store.file_content("acme", b[field]).split(b"\n") if x]
    assert sorted(found) == sorted(f"r{i}" for i in range(n))
    counts = b["request_counts"]
    assert counts["total"] == counts["completed"] + counts["failed"] == n
    return b


def test_lines_left_running_by_a_killed_gateway_end_cancelled_when_it_starts_again(tmp_path):
    store, bid = started(tmp_path / "b.db")
    (a, b, c) = store.claim(bid, 3)
    store.record(bid, a[0], a[1], 200, {}, "r")
    store.cancel(bid)
    store.close()  # kill -9: b and c were running
    again = BatchStore(tmp_path / "b.db")
    assert again.requeue_running() == 2
    assert again.counts(bid)["running"] == again.counts(bid)["pending"] == 0
    again.finish(bid, Status.CANCELLED)
    assert every_line_once(again, bid, 6)["status"] == "cancelled"


def test_a_line_put_back_while_its_batch_cancels_ends_cancelled_and_none_is_claimed(tmp_path):
    store, bid = started(tmp_path / "b.db")
    (a, b) = store.claim(bid, 2)
    store.cancel(bid)
    assert store.release(bid, a[0]) == "failed"
    assert store.claim(bid, 10) == []
    store.record(bid, b[0], b[1], 200, {}, "r")
    store.finish(bid, Status.CANCELLED)
    every_line_once(store, bid, 6)


def test_a_line_put_back_while_in_progress_runs_again(tmp_path):
    store, bid = started(tmp_path / "b.db")
    (a,) = store.claim(bid, 1)
    assert store.release(bid, a[0]) == "pending"
    assert store.claim(bid, 1)[0][0] == a[0]


def test_lines_split_on_newline_only_whatever_the_chunks():
    content = b'{"a": "x\xe2\x80\xa8y"}\r\n\n  \nsecond\x85line\r\nlast'
    expected = [b'{"a": "x\xe2\x80\xa8y"}', b"", b"  ", b"second\x85line", b"last"]
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(content)), rng.randint(0, 8)))
        chunks = [content[i:j] for i, j in zip([0, *cuts], [*cuts, len(content)], strict=True)]
        assert list(raw_lines(chunks)) == expected
        assert count_lines(chunks) == 3


def test_a_line_over_the_limit_is_dropped_as_it_comes():
    lines = list(raw_lines([b"short\n", b"x" * 10, b"y" * 10, b"\nok\n", b"z" * 30], max_line_bytes=16))
    assert lines == [b"short", b"", b"ok", b""] and [isinstance(x, TooLong) for x in lines] == [
        False, True, False, True]
