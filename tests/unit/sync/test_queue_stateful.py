"""A stateful property test of the offline queue (Hypothesis): random sequences of enqueue,
claim, ack, fail, retry, expire, lease run-out, recover and kill (the process dies: the SQLite
file is reopened) against a plain model. After every step: nothing acknowledged is lost (every
id enqueued is there, in the model's state), a session's items are never claimed out of order,
and the pending counters (kept by triggers) match a count of the rows."""

from __future__ import annotations

import tempfile
from pathlib import Path

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from sync.queue import Kind, NewItem, OfflineQueue, QueueFull, State
from tests.unit.sync.fakes import FakeClock

SESSIONS = st.sampled_from(["a", "b", "c", None])
LEASE_S = 30.0
MAX_ITEMS = 12


class QueueMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.path = Path(self.dir.name) / "q.db"
        self.clock = FakeClock()
        self.queue = self._open()
        self.model: dict[str, dict] = {}  # id -> {"state", "session", "order", "expires", "lease"}
        self.order = 0

    def _open(self) -> OfflineQueue:
        return OfflineQueue(self.path, max_items=MAX_ITEMS, synchronous="OFF", lease_s=LEASE_S, clock=self.clock)

    def teardown(self):
        self.queue.close()
        self.dir.cleanup()

    def _pending(self):
        return {i: m for i, m in self.model.items() if m["state"] in ("queued", "sending")}

    def _expire_model(self):
        now = self.clock.t
        for m in self.model.values():
            if m["state"] == "queued" and m["expires"] <= now:
                m["state"] = "expired"

    @rule(sessions=st.lists(SESSIONS, min_size=1, max_size=3), ttl=st.sampled_from([None, 5.0, 60.0]))
    def enqueue(self, sessions, ttl):
        items = [NewItem(Kind.REQUEST, {"n": self.order + k}, endpoint="chat", session=s, ttl_s=ttl)
                 for k, s in enumerate(sessions)]
        try:
            ids = self.queue.enqueue_many(items)
        except QueueFull:
            assert len(self._pending()) + len(items) > MAX_ITEMS  # refused only when it really does not fit
            return
        assert len(self._pending()) + len(items) <= MAX_ITEMS
        for item_id, s in zip(ids, sessions, strict=True):
            assert item_id is not None
            self.order += 1
            self.model[item_id] = {"state": "queued", "session": s, "order": self.order,
                                   "expires": self.clock.t + (ttl if ttl is not None else 7 * 86400), "lease": 0.0}

    @rule(limit=st.integers(1, 5))
    def claim(self, limit):
        now = self.clock.t
        self._expire_model()
        for m in self.model.values():  # a lease that ran out puts the item back
            if m["state"] == "sending" and m["lease"] <= now:
                m["state"] = "queued"
        got = self.queue.claim(Kind.REQUEST, limit)
        assert len(got) <= limit
        for it in got:
            m = self.model[it.id]
            assert m["state"] == "queued", (it.id, m)
            if m["session"] is not None:  # the head of its session: nothing earlier still pending
                assert not any(o["session"] == m["session"] and o["order"] < m["order"]
                               and o["state"] in ("queued", "sending") for o in self.model.values())
        for it in got:
            self.model[it.id].update(state="sending", lease=now + LEASE_S)
        if not got:  # nothing claimable: then no queued item is a session head that is due
            heads = [m for m in self.model.values() if m["state"] == "queued" and (m["session"] is None or not any(
                o["session"] == m["session"] and o["order"] < m["order"] and o["state"] in ("queued", "sending")
                for o in self.model.values()))]
            assert not heads, heads

    def _sending(self):
        return sorted(i for i, m in self.model.items() if m["state"] == "sending")

    @precondition(lambda self: self._sending())
    @rule(data=st.data(), ok=st.booleans())
    def settle(self, data, ok):
        item_id = data.draw(st.sampled_from(self._sending()))
        self.queue.complete(item_id, 200 if ok else 400, {"ok": ok}, failed=not ok)
        self.model[item_id]["state"] = "done" if ok else "failed"

    @precondition(lambda self: self._sending())
    @rule(data=st.data())
    def retry_later(self, data):
        item_id = data.draw(st.sampled_from(self._sending()))
        self.queue.retry_later(item_id, "HTTP 503", 0.0)
        self.model[item_id]["state"] = "queued"

    @rule(dt=st.sampled_from([1.0, 10.0, 31.0, 61.0]))
    def time_passes(self, dt):
        self.clock.t += dt

    @rule()
    def expire(self):
        self.queue.expire()
        self._expire_model()

    @rule()
    def kill_and_restart(self):
        """The agent dies (nothing closed cleanly) and starts again: reopen, recover."""
        self.queue._db.conn.close()
        self.queue = self._open()
        self.queue.recover()
        for m in self.model.values():
            if m["state"] == "sending":
                m["state"] = "queued"

    @rule(state=st.sampled_from(["failed", "expired"]))
    def operator_retries(self, state):
        self.queue.retry(state=state)
        for m in self.model.values():
            if m["state"] == state:
                m["state"] = "queued"
                m["expires"] = self.clock.t + 7 * 86400  # a fresh TTL

    @invariant()
    def nothing_is_lost_and_states_match(self):
        for item_id, m in self.model.items():
            it = self.queue.get(item_id)
            assert it is not None, f"{item_id} lost"
            assert it.state == m["state"] or (m["state"] == "queued" and it.state == State.EXPIRED
                                                and m["expires"] <= self.clock.t), (item_id, it.state, m)
            if it.state != m["state"]:  # expired in the store before the model looked: follow it
                m["state"] = "expired"

    @invariant()
    def counters_match_the_rows(self):
        n = self.queue._db.conn.execute("SELECT count(*), coalesce(sum(bytes), 0) FROM outbox "
                                        "WHERE state IN ('queued', 'sending')").fetchone()
        assert (self.queue.pending()["items"], self.queue.pending()["bytes"]) == tuple(n)
        assert n[0] == len(self._pending())


TestOfflineQueue = QueueMachine.TestCase
TestOfflineQueue.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
