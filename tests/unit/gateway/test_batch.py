"""The Batch API without a server: the JSONL validation, the state machine, the durable store
(every line ends exactly once, a restart runs only what had not finished), the throttle."""

from __future__ import annotations

import json

import pytest

from cloud_tier.gateway.batch.jsonl import validate
from cloud_tier.gateway.batch.runner import RunnerConfig, spare_slots
from cloud_tier.gateway.batch.state import (
    TRANSITIONS,
    InvalidTransition,
    Status,
    check_transition,
    next_status,
    window_seconds,
)
from cloud_tier.gateway.batch.store import BatchStore, batch_object

CHAT = "/v1/chat/completions"


def line(cid, url=CHAT, body=None, method="POST") -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url,
                       "body": body if body is not None else {"model": "m", "messages": []}})


def jsonl(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


# -- validation ---------------------------------------------------------------------------------

def test_good_lines_run_and_bad_ones_go_to_the_error_file():
    v = validate(jsonl(line("a"), "{not json", "", line("b", url="/v1/completions"), line("c", method="GET"),
                       json.dumps({"custom_id": "d", "method": "POST", "url": CHAT, "body": [1]}), line("e")),
                 CHAT, 100)
    assert v.errors == []
    assert [(ln.index, ln.custom_id, ln.error and ln.error["code"]) for ln in v.lines] == [
        (0, "a", None), (1, None, "invalid_json_line"), (2, "b", "invalid_url"), (3, "c", "invalid_method"),
        (4, "d", "invalid_body"), (5, "e", None)]


def test_a_line_nested_past_the_parser_is_that_lines_error():
    deep = '{"custom_id": "x", "body": ' + "[" * 50_000 + "]" * 50_000 + "}"
    v = validate(jsonl(line("a"), deep, line("b")), CHAT, 100)
    assert [(ln.custom_id, ln.error and ln.error["code"]) for ln in v.lines] == [
        ("a", None), (None, "invalid_json_line"), ("b", None)]


def test_a_line_is_answered_whole_in_the_batch_class():
    v = validate(jsonl(line("a", body={"model": "m", "messages": [], "stream": True, "priority_class": "interactive",
                                       "stream_options": {"include_usage": True}, "max_tokens": 3})), CHAT, 10)
    assert v.lines[0].body == {"model": "m", "messages": [], "max_tokens": 3}


@pytest.mark.parametrize("content,code,line_no", [
    (jsonl(line("a"), line("a")), "duplicate_custom_id", 2),
    (jsonl(line("a"), line("")), "missing_custom_id", 2),
    (jsonl(line("a"), json.dumps({"method": "POST", "url": CHAT, "body": {}})), "missing_custom_id", 2),
    (jsonl(line("a"), line(7)), "missing_custom_id", 2),
    (b"\n\n", "empty_file", None),
    (b"\xff\xfe", "invalid_file_encoding", 1),  # the line it is on
    (jsonl(line("a"), line("b"), line("c")), "too_many_requests", None),
])
def test_a_file_that_is_no_valid_batch_fails_validation(content, code, line_no):
    errors = validate(content, CHAT, 2).errors
    assert [(e["code"], e["line"]) for e in errors] == [(code, line_no)]


# -- the state machine --------------------------------------------------------------------------

def test_final_states_go_nowhere_and_others_only_forward():
    for status, targets in TRANSITIONS.items():
        assert not targets if status.final else targets
    check_transition(Status.IN_PROGRESS, Status.CANCELLING)
    with pytest.raises(InvalidTransition):
        check_transition(Status.COMPLETED, Status.CANCELLING)
    with pytest.raises(InvalidTransition):
        check_transition(Status.FINALIZING, Status.IN_PROGRESS)


@pytest.mark.parametrize("status,pending,running,now,nxt", [
    (Status.IN_PROGRESS, 3, 1, 10, None),
    (Status.IN_PROGRESS, 0, 0, 10, Status.FINALIZING),
    (Status.IN_PROGRESS, 0, 1, 100, Status.EXPIRED),  # the window passed with a line unfinished
    (Status.IN_PROGRESS, 0, 0, 100, Status.FINALIZING),  # ... all finished: completed, late or not
    (Status.CANCELLING, 0, 2, 10, None),  # its running lines finish first
    (Status.CANCELLING, 0, 0, 10, Status.CANCELLED),
    (Status.FINALIZING, 0, 0, 10, Status.COMPLETED),
    (Status.COMPLETED, 0, 0, 10, None),
])
def test_next_status(status, pending, running, now, nxt):
    assert next_status(status, pending, running, now, expires_at=50) is nxt


def test_completion_windows():
    assert window_seconds("24h") == 86400 and window_seconds("90s") == 90 and window_seconds("5m") == 300
    for bad in ("25h", "0s", "1d", "", "24 h", None, "-1h"):
        with pytest.raises(ValueError):
            window_seconds(bad)


# -- the store ----------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def started(tmp_path, n=4, clock=None):
    store = BatchStore(tmp_path / "b.db", clock=clock or Clock())
    f = store.add_file("acme", "batch", "in.jsonl", jsonl(*(line(f"r{i}") for i in range(n)), "oops"))
    bid = store.create_batch("acme", "k1", CHAT, f["id"], "24h", 86400, {"job": "x"})
    store.start(bid, validate(store.file_content("acme", f["id"]), CHAT, 100).lines)
    return store, bid


def lines_of(store, tenant, file_id) -> list[dict]:
    return [json.loads(x) for x in store.file_content(tenant, file_id).splitlines()]


def test_every_line_ends_once_and_the_files_hold_them_in_order(tmp_path):
    store, bid = started(tmp_path)
    first = store.claim(bid, 3)
    assert [i for i, _, _ in first] == [0, 1, 2] and store.counts(bid)["running"] == 3
    for i, cid, _ in first:
        assert store.record(bid, i, cid, 200 if i != 1 else 400, {"i": i}, f"req-{i}")
    assert not store.record(bid, 0, "r0", 200, {"again": True}, "x")  # a line ends once
    (last,) = store.claim(bid, 5)
    store.record(bid, last[0], last[1], 200, {"i": 3}, "req-3")
    assert store.claim(bid, 5) == []
    store.finish(bid, Status.COMPLETED)
    b = batch_object(store.batch(bid), store.counts(bid))
    assert b["status"] == "completed" and b["request_counts"] == {"total": 5, "completed": 3, "failed": 2}
    assert b["finalizing_at"] and b["completed_at"] and b["metadata"] == {"job": "x"}
    out = lines_of(store, "acme", b["output_file_id"])
    assert [(o["custom_id"], o["response"]["status_code"], o["response"]["body"]) for o in out] == [
        ("r0", 200, {"i": 0}), ("r2", 200, {"i": 2}), ("r3", 200, {"i": 3})]
    err = lines_of(store, "acme", b["error_file_id"])
    assert [(e["custom_id"], e["response"] and e["response"]["status_code"], e["error"] and e["error"]["code"])
            for e in err] == [("r1", 400, None), (None, None, "invalid_json_line")]
    assert store.get_file("globex", b["output_file_id"]) is None  # another tenant's


def test_a_restart_runs_the_lines_left_running_and_never_the_finished(tmp_path):
    store, bid = started(tmp_path)
    (a, b) = store.claim(bid, 2)
    store.record(bid, a[0], a[1], 200, {}, "r")
    store.close()
    again = BatchStore(tmp_path / "b.db")
    assert again.requeue_running() == 1
    assert [i for i, _, _ in again.claim(bid, 10)] == [1, 2, 3]
    assert again.counts(bid) == {"pending": 0, "running": 3, "done": 1, "failed": 1}


def test_cancel_ends_lines_not_started_and_keeps_what_finished(tmp_path):
    store, bid = started(tmp_path)
    (a,) = store.claim(bid, 1)
    store.cancel(bid)
    assert store.claim(bid, 10) == []
    store.record(bid, a[0], a[1], 200, {"ok": 1}, "r")  # a line running at the cancel finishes
    store.finish(bid, Status.CANCELLED)
    b = batch_object(store.batch(bid), store.counts(bid))
    assert b["status"] == "cancelled" and b["cancelling_at"] and b["cancelled_at"]
    assert [o["custom_id"] for o in lines_of(store, "acme", b["output_file_id"])] == ["r0"]
    codes = [e["error"]["code"] for e in lines_of(store, "acme", b["error_file_id"])]
    assert sorted(codes) == ["batch_cancelled"] * 3 + ["invalid_json_line"]


def test_expiry_ends_every_unfinished_line_as_batch_expired(tmp_path):
    clock = Clock()
    store, bid = started(tmp_path, clock=clock)
    (a, b) = store.claim(bid, 2)
    store.record(bid, a[0], a[1], 200, {}, "r")
    clock.now += 86401
    store.expire(bid)
    assert not store.record(bid, b[0], b[1], 200, {}, "late")  # finished after the expiry: not counted twice
    row = batch_object(store.batch(bid), store.counts(bid))
    assert row["status"] == "expired" and row["expired_at"] == 87401
    errs = lines_of(store, "acme", row["error_file_id"])
    assert sorted(e["custom_id"] or "" for e in errs if e["error"]["code"] == "batch_expired") == ["r1", "r2", "r3"]
    assert row["request_counts"] == {"total": 5, "completed": 1, "failed": 4}


def test_failed_validation_keeps_the_errors(tmp_path):
    store = BatchStore(tmp_path / "b.db")
    f = store.add_file("acme", "batch", "in.jsonl", jsonl(line("a"), line("a")))
    bid = store.create_batch("acme", "k1", CHAT, f["id"], "24h", 86400, None)
    store.fail(bid, validate(store.file_content("acme", f["id"]), CHAT, 10).errors)
    b = batch_object(store.batch(bid), store.counts(bid))
    assert b["status"] == "failed" and b["errors"]["data"][0]["code"] == "duplicate_custom_id"
    assert b["request_counts"] == {"total": 0, "completed": 0, "failed": 0} and b["output_file_id"] is None


def test_listings_are_newest_first_per_tenant_and_page_by_id(tmp_path):
    store = BatchStore(tmp_path / "b.db")
    ids = [store.add_file("acme", "batch", f"{i}.jsonl", b"x")["id"] for i in range(3)]
    store.add_file("globex", "batch", "g.jsonl", b"x")
    page, more = store.list_files("acme", None, None, 2)
    assert [f["id"] for f in page] == ids[:0:-1] and more
    page, more = store.list_files("acme", "batch", page[-1]["id"], 2)
    assert [f["id"] for f in page] == ids[:1] and not more
    assert store.delete_file("acme", ids[0]) and not store.delete_file("globex", ids[1])


# -- the throttle -------------------------------------------------------------------------------

@pytest.mark.parametrize("in_flight,online,waiting,shares,slots", [
    (0, 0, 0, [0.1], 4),
    (3, 0, 0, [0.1, 0.9], 1),
    (4, 0, 0, [0.1], 0),
    (0, 0, 1, [0.1], 0),  # an online request waits for KV room
    (0, 0, 0, [0.6, 1.0], 0),  # every worker past the share (1.0: its engine queues requests)
    (0, 0, 0, [], 0),  # no healthy worker
    (1, 1, 0, [0.1], 3),
    (0, 2, 0, [0.1], 0),  # online_busy online requests in flight
])
def test_lines_start_only_into_spare_capacity(in_flight, online, waiting, shares, slots):
    config = RunnerConfig(concurrency=4, kv_share=0.5, online_busy=2)
    assert spare_slots(config, in_flight, online, waiting, shares) == slots


def test_without_online_busy_online_requests_in_flight_do_not_hold_lines_back():
    assert spare_slots(RunnerConfig(concurrency=4, kv_share=0.5), 1, 100, 0, [0.1]) == 3
