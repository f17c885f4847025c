import multiprocessing
import os
import uuid

import pytest

from sync.ids import timestamp_ms, uuid7
from sync.queue import Kind, NewItem, OfflineQueue, QueueFull, State
from tests.unit.sync.fakes import FakeClock


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def queue(tmp_path, clock):
    q = OfflineQueue(tmp_path / "queue.db", max_items=5, max_bytes=1 << 20, request_ttl_s=100,
                     telemetry_ttl_s=50, keep_s=1000, lease_s=30, clock=clock)
    yield q
    q.close()


def req(i: int, **kw) -> NewItem:
    return NewItem(Kind.REQUEST, {"messages": [{"role": "user", "content": f"q{i}"}]}, endpoint="chat", **kw)


def tel(i: int) -> NewItem:
    return NewItem(Kind.TELEMETRY, {"n": i})


def test_uuid7_is_a_version_7_uuid_sorted_in_creation_order():
    ids = [uuid7() for _ in range(5000)]  # several per millisecond
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in ids)
    assert ids == sorted(ids, key=lambda u: u.int) and len(set(ids)) == len(ids)
    assert abs(timestamp_ms(ids[0]) / 1000 - __import__("time").time()) < 5
    # a clock that steps back does not reorder ids
    a = uuid7(now_ms=2_000_000_000_000)
    b = uuid7(now_ms=1_000_000_000_000)
    assert b.int > a.int


def test_an_item_goes_queued_sending_done_with_its_result_in_the_inbox(queue):
    (i,) = queue.enqueue_many([req(1)])
    assert uuid.UUID(i).version == 7
    assert queue.get(i).state == State.QUEUED
    (claimed,) = queue.claim(Kind.REQUEST, 10)
    assert claimed.id == i and claimed.attempts == 1 and queue.get(i).state == State.SENDING
    assert queue.claim(Kind.REQUEST, 10) == []  # leased
    queue.complete(i, 200, {"choices": [{"message": {"content": "hi"}}]})
    got = queue.get(i)
    assert got.state == State.DONE and got.result_status == 200
    assert got.result["choices"][0]["message"]["content"] == "hi"
    assert got.payload == req(1).payload


def test_a_refusal_is_failed_and_a_passing_failure_comes_back_after_its_delay(queue, clock):
    a, b = queue.enqueue_many([req(1), req(2)])
    queue.claim(Kind.REQUEST, 10)
    queue.complete(a, 400, {"error": {"message": "bad"}}, failed=True)
    queue.retry_later(b, "HTTP 503", 10)
    assert queue.get(a).state == State.FAILED and queue.get(a).result["error"]["message"] == "bad"
    assert queue.get(b).state == State.QUEUED and queue.get(b).last_error == "HTTP 503"
    assert queue.claim(Kind.REQUEST, 10) == []
    clock.t += 10
    (again,) = queue.claim(Kind.REQUEST, 10)
    assert again.id == b and again.attempts == 2


def test_per_session_fifo_only_the_head_of_a_session_is_claimed(queue):
    ids = queue.enqueue_many([req(1, session="s1"), req(2, session="s1"), req(3, session="s2"),
                              req(4), req(5, session="s1")])
    first = {it.id for it in queue.claim(Kind.REQUEST, 10)}
    assert first == {ids[0], ids[2], ids[3]}  # s1's head, s2's head, the session-less one
    queue.complete(ids[0], 200, {})
    assert [it.id for it in queue.claim(Kind.REQUEST, 10)] == [ids[1]]
    queue.retry_later(ids[1], "down", 0)  # a retried head still holds its session back
    assert [it.id for it in queue.claim(Kind.REQUEST, 10)] == [ids[1]]
    queue.complete(ids[1], 200, {})
    assert [it.id for it in queue.claim(Kind.REQUEST, 10)] == [ids[4]]


def test_priority_first_then_arrival_order(queue):
    ids = queue.enqueue_many([req(1), req(2, priority=5), req(3)])
    assert [it.id for it in queue.claim(Kind.REQUEST, 2)] == [ids[1], ids[0]]


def test_leases_run_out_and_recover_requeues_what_a_dead_process_was_sending(queue, clock):
    a, b = queue.enqueue_many([req(1), req(2)])
    queue.claim(Kind.REQUEST, 1)
    clock.t += 31
    assert [it.id for it in queue.claim(Kind.REQUEST, 5)] == [a, b]  # a's lease ran out
    assert queue.recover() == 2
    assert {it.state for it in queue.items()} == {"queued"}


def test_ttl_expires_requests_and_deletes_telemetry(queue, clock):
    r, t = queue.enqueue_many([req(1), tel(1)])
    short = queue.enqueue("request", {"x": 1}, endpoint="chat", ttl_s=5)
    clock.t += 6
    assert queue.expire() == 1 and queue.get(short).state == State.EXPIRED
    clock.t += 45  # telemetry TTL 50
    queue.expire()
    assert queue.get(t) is None and queue.get(r).state == State.QUEUED
    clock.t += 50
    assert queue.claim(Kind.REQUEST, 5) == [] and queue.get(r).state == State.EXPIRED
    assert queue.retry(state="expired") == 2 and queue.get(r).state == State.QUEUED


def test_a_full_queue_drops_telemetry_oldest_first_then_refuses_requests(queue):
    tels = queue.enqueue_many([tel(i) for i in range(3)])
    reqs = queue.enqueue_many([req(1), req(2)])  # 5 = max_items
    r3 = queue.enqueue("request", {"q": 3}, endpoint="chat")  # room made by dropping the oldest telemetry
    assert queue.get(tels[0]) is None and queue.get(tels[1]) is not None and queue.get(r3) is not None
    assert queue.enqueue("telemetry", {"n": 9}) is not None  # new telemetry displaces old telemetry
    assert queue.get(tels[1]) is None
    queue.enqueue_many([req(4), req(5)])  # drops the rest of the telemetry
    assert queue.stats()["by_kind"]["telemetry"]["queued"] == 0
    with pytest.raises(QueueFull, match="full"):
        queue.enqueue("request", {"q": 6}, endpoint="chat")
    assert queue.enqueue("telemetry", {"n": 10}) is None  # dropped, never a request
    assert queue.stats()["telemetry_dropped"] == 5
    assert all(queue.get(i).state == State.QUEUED for i in reqs)
    # a finished item no longer counts against the bound
    queue.claim(Kind.REQUEST, 1)
    queue.complete(reqs[0], 200, {})
    queue.enqueue("request", {"q": 7}, endpoint="chat")


def test_a_batch_of_requests_that_does_not_fit_is_refused_whole(queue):
    queue.enqueue_many([req(1), req(2), req(3)])
    with pytest.raises(QueueFull):
        queue.enqueue_many([req(4), req(5), req(6)])
    assert queue.stats()["pending_items"] == 3


def test_the_byte_bound_counts_too(tmp_path):
    q = OfflineQueue(tmp_path / "q.db", max_items=100, max_bytes=200)
    q.enqueue("request", {"x": "a" * 100}, endpoint="chat")
    with pytest.raises(QueueFull):
        q.enqueue("request", {"x": "a" * 100}, endpoint="chat")


def test_stats_count_by_state_and_kind_with_the_oldest_age(queue, clock):
    queue.enqueue_many([req(1), tel(1)])
    clock.t += 7
    queue.enqueue_many([req(2)])
    queue.claim(Kind.REQUEST, 1)
    s = queue.stats()
    assert s["by_kind"]["request"]["queued"] == 1 and s["by_kind"]["request"]["sending"] == 1
    assert s["by_kind"]["telemetry"]["queued"] == 1
    assert s["pending_items"] == 3 and s["oldest_pending_age_s"] == 7 and s["bytes"] > 0


def test_drop_and_retry_by_id_and_state(queue):
    a, b, c = queue.enqueue_many([req(1), req(2), tel(3)])
    queue.claim(Kind.REQUEST, 5)
    queue.complete(a, 422, {"error": {}}, failed=True)
    assert queue.retry([a]) == 1 and queue.get(a).state == State.QUEUED and queue.get(a).result is None
    assert queue.drop(kind="telemetry") == 1 and queue.get(c) is None
    assert queue.drop([b]) == 1 and queue.get(b) is None
    with pytest.raises(ValueError):
        queue.drop()


def test_collect_deletes_finished_items_after_keep_s(queue, clock):
    a, b = queue.enqueue_many([req(1), req(2)])
    queue.claim(Kind.REQUEST, 1)
    queue.complete(a, 200, {})
    clock.t += 1001
    assert queue.collect() == 1 and queue.get(a) is None and queue.get(b) is not None


def test_ack_deletes_telemetry(queue):
    t1, t2 = queue.enqueue_many([tel(1), tel(2)])
    assert [it.id for it in queue.claim(Kind.TELEMETRY, 5)] == [t1, t2]
    assert queue.ack([t1]) == 1 and queue.get(t1) is None and queue.get(t2).state == State.SENDING


def _enqueue_and_die(path: str, start: int, conn) -> None:
    q = OfflineQueue(path)
    for i in range(start, start + 10_000):
        q.enqueue("request", {"i": i}, endpoint="chat")
        conn.send(i)  # the acknowledgement: sent only after the commit returned
    os._exit(0)


def test_every_acknowledged_enqueue_survives_a_kill(tmp_path):
    path = str(tmp_path / "q.db")
    ctx = multiprocessing.get_context("spawn")
    acked: set[int] = set()
    for round_ in range(3):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_enqueue_and_die, args=(path, round_ * 100_000, child))
        p.start()
        while len(acked) < (round_ + 1) * 30:
            acked.add(parent.recv())
        p.kill()
        p.join()
        while parent.poll():
            acked.add(parent.recv())
    q = OfflineQueue(path)
    stored = {it.payload["i"] for it in q.items(limit=1_000_000)}
    assert acked <= stored


def test_the_pending_counters_kept_by_triggers_match_a_recount(tmp_path, clock):
    import random

    rng = random.Random(1)
    q = OfflineQueue(tmp_path / "q.db", max_items=40, max_bytes=4000, request_ttl_s=5, clock=clock)
    for _ in range(400):
        op = rng.random()
        try:
            if op < 0.35:
                q.enqueue_many([req(rng.randrange(99)) if rng.random() < 0.6 else tel(1)
                                for _ in range(rng.randrange(1, 4))])
        except QueueFull:
            pass
        if 0.35 <= op < 0.55:
            for it in q.claim(rng.choice(list(Kind)), 3):
                rng.choice([lambda i=it: q.complete(i.id, 200, {}), lambda i=it: q.retry_later(i.id, "x", 0),
                            lambda i=it: q.ack([i.id]), lambda i=it: q.release([i.id])])()
        elif op < 0.6:
            clock.t += 2
            q.expire()
        elif op < 0.65:
            q.retry(state="expired")
        elif op < 0.7 and (items := q.items()):
            q.drop([rng.choice(items).id])
        elif op < 0.72:
            q.recover()
        recount = q._db.conn.execute(
            "SELECT count(*), coalesce(sum(bytes), 0) FROM outbox WHERE state IN ('queued', 'sending')").fetchone()
        p = q.pending()
        assert (p["items"], p["bytes"]) == recount
    q.close()
    reopened = OfflineQueue(tmp_path / "q.db")  # recounted when opened
    assert reopened.pending()["items"] == recount[0]


def test_group_commit_shares_transactions_and_answers_each_caller(tmp_path):
    import asyncio

    from sync.group_commit import GroupCommit

    class Counting(OfflineQueue):
        commits = 0

        def enqueue_many(self, items):
            Counting.commits += 1
            return super().enqueue_many(items)

    async def put_all(writer, n):
        return await asyncio.gather(*(writer.put(req(i)) for i in range(n)), return_exceptions=True)

    q = Counting(tmp_path / "q.db")
    ids = asyncio.run(put_all(GroupCommit(q), 60))
    assert Counting.commits <= 2  # 60 callers, one or two transactions
    assert {it.id for it in q.items(limit=100)} == set(ids) and len(set(ids)) == 60

    full = OfflineQueue(tmp_path / "full.db", max_items=50)
    results = asyncio.run(put_all(GroupCommit(full), 60))
    accepted = [r for r in results if isinstance(r, str)]
    assert len(accepted) == 50 and sum(isinstance(r, QueueFull) for r in results) == 10  # each its own answer
    assert {it.id for it in full.items(limit=100)} == set(accepted)


def test_one_item_sqlite_refuses_fails_only_itself_in_a_group_commit(tmp_path):
    """issue 12, item 6: a priority SQLite cannot store made 10 of 13 concurrent enqueues fail."""
    import asyncio

    from sync.group_commit import GroupCommit

    async def put_all(writer):
        items = [req(i) for i in range(12)]
        items.insert(5, NewItem(Kind.REQUEST, {"q": "bad"}, endpoint="chat", priority=2**70))
        return await asyncio.gather(*(writer.put(it) for it in items), return_exceptions=True)

    q = OfflineQueue(tmp_path / "q.db")
    results = asyncio.run(put_all(GroupCommit(q)))
    assert isinstance(results[5], OverflowError | ValueError)  # sqlite3: Python int too large to convert
    assert all(isinstance(r, str) for i, r in enumerate(results) if i != 5)
    assert len(q.items(limit=100)) == 12


def test_an_app_key_enqueues_once_and_a_reused_key_for_another_request_is_refused(queue):
    from sync.queue import KeyReused

    a = queue.enqueue("request", {"q": 1}, endpoint="chat", app_key="k1")
    assert queue.enqueue("request", {"q": 1}, endpoint="chat", app_key="k1") == a  # the app's retry
    b, c, d = queue.enqueue_many([req(2, app_key="k2"), req(2, app_key="k2"), req(3)])
    assert b == c != d and queue.stats()["pending_items"] == 3
    with pytest.raises(KeyReused):
        queue.enqueue("request", {"q": 2}, endpoint="chat", app_key="k1")


def test_a_telemetry_record_too_large_to_ever_fit_costs_no_other_record(tmp_path, clock):
    q = OfflineQueue(tmp_path / "small.db", max_items=10, max_bytes=2000, clock=clock)
    kept = [q.enqueue("telemetry", {"n": i, "pad": "x" * 100}) for i in range(5)]
    assert q.enqueue("telemetry", {"huge": "x" * 5000}) is None  # dropped by itself
    assert q.stats()["by_kind"]["telemetry"]["queued"] == 5 and all(q.get(i) for i in kept)
    assert q.stats()["telemetry_dropped"] == 1
    q.close()
