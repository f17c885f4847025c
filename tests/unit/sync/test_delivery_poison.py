"""Issue 37 item 1: a request the cloud fails every time (a poison item) ends ``failed`` after
``max_attempts``, never opens the device's circuit, and holds its session back only until then.
A real SQLite queue and delivery loop; the cloud's answers are scripted per prompt."""

from __future__ import annotations

import asyncio

import pytest

from cascade.policy.backpressure import CircuitBreaker
from sync.delivery import DeliveryConfig, DeliveryLoop, Outcome, openai_error
from sync.queue import Kind, OfflineQueue, State
from tests.unit.sync.fakes import FakeClock

OPENAI_500 = {"error": {"message": "the model failed on this prompt", "type": "server_error", "param": None,
                        "code": "internal_error"}}


class Cloud:
    """Up; answers 500 (an OpenAI error, or ``poison_body``) for the prompt "poison", 200 otherwise."""

    def __init__(self, poison_status: int = 500, poison_body=OPENAI_500):
        self.poison_status, self.poison_body = poison_status, poison_body
        self.sent: list[str] = []

    async def send(self, item) -> Outcome:
        self.sent.append(item.payload["q"])
        if item.payload["q"] == "poison":
            return Outcome(self.poison_status, self.poison_body, error=f"HTTP {self.poison_status}: boom")
        return Outcome(200, {"choices": [{"message": {"content": item.payload["q"]}}]})

    async def probe(self) -> bool:
        return True


@pytest.fixture
def queue(tmp_path):
    q = OfflineQueue(tmp_path / "q.db", synchronous="NORMAL")
    yield q
    q.close()


def make(queue, cloud, max_attempts=3) -> DeliveryLoop:
    breaker = CircuitBreaker(base_backoff_s=60.0, max_backoff_s=60.0, clock=FakeClock())
    return DeliveryLoop(queue, cloud.send, cloud.probe, breaker,
                        DeliveryConfig(base_backoff_s=0.0, max_backoff_s=0.0, poll_s=0.05, max_attempts=max_attempts))


def put(queue, q, session=None):
    return queue.enqueue(Kind.REQUEST, {"q": q}, endpoint="chat", session=session)


def test_a_poison_item_fails_after_max_attempts_with_the_circuit_closed_and_others_delivered(queue):
    async def main():
        cloud = Cloud()
        loop = make(queue, cloud)
        poison, after = put(queue, "poison", "s1"), put(queue, "after poison", "s1")
        others = [put(queue, f"other {n}", f"s{n + 2}") for n in range(3)]
        await loop.run_once()
        assert loop.breaker.state == "closed"  # the cloud answered about that request only
        assert all(queue.get(i).state == State.DONE for i in others)
        for n in (1, 2):
            assert queue.get(poison).state == State.QUEUED and queue.get(poison).failures == n
            assert queue.get(after).state == State.QUEUED and queue.get(after).attempts == 0  # behind it
            late = put(queue, f"late {n}", f"late{n}")  # meanwhile, other sessions' requests go at once
            await loop.run_once()
            assert queue.get(late).state == State.DONE and loop.breaker.state == "closed"
        failed = queue.get(poison)
        assert failed.state == State.FAILED and failed.failures == 2 and failed.attempts == 3
        assert failed.result_status == 500 and failed.result == OPENAI_500
        assert failed.last_error.startswith("failed 3 times: HTTP 500")
        await loop.run_once()  # its session goes on
        assert queue.get(after).state == State.DONE and cloud.sent.count("poison") == 3
        assert queue.retry([poison]) == 1  # `cascade edge queue retry`: queued again, its count afresh
        assert queue.get(poison).state == State.QUEUED and queue.get(poison).failures == 0

    asyncio.run(main())


def test_signs_of_an_outage_open_the_circuit_and_never_count_against_the_item(queue):
    async def main():
        for status, body in [(503, OPENAI_500), (502, None), (429, OPENAI_500), (0, None)]:
            cloud = Cloud(status, body)
            loop = make(queue, cloud, max_attempts=1)
            item = put(queue, "poison")
            await loop.run_once()
            assert loop.breaker.state == "open", status
            assert queue.get(item).state == State.QUEUED and queue.get(item).failures == 0
            queue.drop([item])

    asyncio.run(main())


def test_a_500_that_is_not_an_openai_answer_opens_the_circuit_and_still_counts(queue):
    async def main():
        cloud = Cloud(500, {"error": {"message": "<html>proxy error</html>", "type": "upstream_error"}})
        loop = make(queue, cloud, max_attempts=1)
        item = put(queue, "poison")
        await loop.run_once()
        assert loop.breaker.state == "open" and queue.get(item).state == State.FAILED

    asyncio.run(main())


def test_what_an_openai_error_is():
    assert openai_error(OPENAI_500)
    assert openai_error({"object": "error", "message": "m", "type": "t", "param": None, "code": 500})  # vLLM
    for no in (None, "x", {}, {"error": {}}, {"error": "boom"}, {"detail": "Not Found"},
               {"error": {"message": "m", "type": "upstream_error"}}):
        assert not openai_error(no)
    assert Outcome(500, OPENAI_500).own_failure and not Outcome(500, OPENAI_500).cloud_unavailable
    assert Outcome(404, OPENAI_500).own_failure and not Outcome(404, OPENAI_500).refused
    for down in (0, 408, 429, 502, 503, 504, 401, 403):
        assert Outcome(down, OPENAI_500).cloud_unavailable and not Outcome(down, OPENAI_500).own_failure
    assert not Outcome(409).cloud_unavailable and not Outcome(409).own_failure
    assert Outcome(400, OPENAI_500).refused and not Outcome(400).own_failure


def test_a_done_item_keeps_no_error_it_waited_on(queue):
    """Issue 37 item 4: the outage's error noted while it waited is cleared once it is done."""
    item = put(queue, "x")
    queue.note_error(Kind.REQUEST, "HTTP 503: the cloud is away")
    queue.claim(Kind.REQUEST, 1)
    queue.complete_many([(item, 200, {"choices": []}, False)])
    assert queue.get(item).state == State.DONE and queue.get(item).last_error == ""
    refused = put(queue, "y")
    queue.claim(Kind.REQUEST, 1)
    queue.complete_many([(refused, 400, OPENAI_500, True, "HTTP 400: no")])
    assert queue.get(refused).last_error == "HTTP 400: no"


def test_new_item_columns_on_an_old_queue_file(tmp_path):
    """A queue file from before the failures column opens, and its items count from 0."""
    import sqlite3

    q = OfflineQueue(tmp_path / "q.db", synchronous="NORMAL")
    item = put(q, "x")
    q.close()
    with sqlite3.connect(tmp_path / "q.db") as conn:
        conn.execute("ALTER TABLE outbox DROP COLUMN failures")
    q = OfflineQueue(tmp_path / "q.db", synchronous="NORMAL")
    assert q.get(item).failures == 0
    q.close()
