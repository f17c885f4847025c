"""The delivery loop's decisions, with a scripted cloud (the faults it must handle, injected)."""

import asyncio
import functools
import random

import pytest

from cascade.policy.backpressure import CircuitBreaker
from sync.delivery import DeliveryConfig, DeliveryLoop, Outcome, backoff_s
from sync.queue import Kind, NewItem, OfflineQueue, State
from tests.unit.sync.fakes import FakeClock

BREAKER_BACKOFF_S = 0.05


class Cloud:
    """Answers each send from a script of statuses (then 200), recording what it was sent."""

    def __init__(self, script=(), up=True):
        self.script = list(script)
        self.up = up
        self.sent: list[str] = []
        self.probes = 0

    async def send(self, item) -> Outcome:
        if not self.up:
            return Outcome(0, error="connection refused")
        self.sent.append(item.id)
        status = self.script.pop(0) if self.script else 200
        body = {"choices": [{"message": {"content": item.payload["q"]}}]} if status == 200 else {"error": {}}
        return Outcome(status, body, retry_after_s=0.0 if status == 429 else None)

    async def probe(self) -> bool:
        self.probes += 1
        return self.up


def in_loop(test):
    @functools.wraps(test)
    def run(*args, **kwargs):
        return asyncio.run(test(*args, **kwargs))
    return run


@pytest.fixture
def queue(tmp_path):
    q = OfflineQueue(tmp_path / "q.db", synchronous="NORMAL")
    yield q
    q.close()


@pytest.fixture
def clock():
    return FakeClock()


def make(queue, cloud, clock: FakeClock | None = None, **config) -> DeliveryLoop:
    """A loop whose items retry at once (no backoff) and whose breaker stays open for
    BREAKER_BACKOFF_S of ``clock`` after each failure: only the test moves that clock."""
    cfg = DeliveryConfig(base_backoff_s=0.0, max_backoff_s=0.0, poll_s=0.05, **config)
    breaker = CircuitBreaker(base_backoff_s=BREAKER_BACKOFF_S, max_backoff_s=BREAKER_BACKOFF_S,
                             clock=clock or FakeClock())
    return DeliveryLoop(queue, cloud.send, cloud.probe, breaker, cfg)


def put(queue, *qs, session=None):
    return queue.enqueue_many([NewItem(Kind.REQUEST, {"q": q}, endpoint="chat", session=session) for q in qs])


def test_backoff_is_exponential_capped_and_jittered():
    cfg = DeliveryConfig(base_backoff_s=1.0, max_backoff_s=8.0)
    rng = random.Random(0)
    for attempts, ceiling in [(1, 1), (2, 2), (3, 4), (4, 8), (10, 8)]:
        values = [backoff_s(attempts, cfg, rng) for _ in range(200)]
        assert all(ceiling / 2 <= v <= ceiling for v in values)
        assert max(values) - min(values) > ceiling / 4  # really jittered


def test_outcomes_done_failed_and_passing():
    assert Outcome(200).delivered and not Outcome(200).refused
    assert Outcome(400).refused and Outcome(422).refused
    for passing in (0, 408, 409, 429, 500, 503, 401):
        o = Outcome(passing)
        assert not o.delivered and not o.refused
    assert Outcome(0).cloud_unavailable and Outcome(503).cloud_unavailable and Outcome(429).cloud_unavailable
    assert not Outcome(409).cloud_unavailable


@in_loop
async def test_a_batch_is_delivered_into_the_inbox(queue):
    ids = put(queue, "a", "b", "c")
    cloud = Cloud(script=[200, 400, 200])
    loop = make(queue, cloud)
    await loop.run_once()
    states = {i: queue.get(i) for i in ids}
    assert [states[i].state for i in ids] == ["done", "failed", "done"]
    assert states[ids[0]].result["choices"][0]["message"]["content"] == "a"
    assert states[ids[1]].result_status == 400
    assert (loop.delivered, loop.failed) == (2, 1)


@in_loop
async def test_a_passing_failure_is_retried_and_the_session_waits_for_it(queue, clock):
    a1, a2 = put(queue, "a1", "a2", session="a")
    cloud = Cloud(script=[503])
    loop = make(queue, cloud, clock)
    await loop.run_once()  # a1 -> 503: back to queued; a2 must not overtake it
    assert queue.get(a1).state == State.QUEUED and queue.get(a1).last_error.startswith("HTTP 503")
    assert queue.get(a2).state == State.QUEUED and cloud.sent == [a1]
    assert loop.breaker.state == "open"  # a 5xx says the cloud is not usable now
    assert await loop.run_once() > 0  # a round while it is open: it sends nothing, and says to wait
    assert cloud.sent == [a1] and cloud.probes == 0
    clock.t += BREAKER_BACKOFF_S
    assert loop.breaker.state == "half_open"
    await loop.run_once()  # a probe closes the circuit, then a1 goes again (a2 still waits for it)
    assert cloud.probes == 1 and loop.breaker.state == "closed"
    assert queue.get(a1).state == State.DONE and queue.get(a2).state == State.QUEUED
    await loop.run_once()
    assert queue.get(a2).state == State.DONE
    assert cloud.sent == [a1, a1, a2]  # in order, a1 once more
    assert cloud.probes == 1  # the circuit was closed again by a probe, not by a blind send


@in_loop
async def test_an_unreachable_cloud_opens_the_shared_breaker_and_nothing_is_sent_until_a_probe(queue, clock):
    (i,) = put(queue, "x")
    cloud = Cloud(up=False)
    loop = make(queue, cloud, clock)
    await loop.run_once()
    assert loop.breaker.state == "open" and queue.get(i).state == State.QUEUED
    assert not loop.breaker.allow()  # the cascade sees the same breaker: it stops escalating too
    await loop.run_once()  # still open: neither a send nor a probe
    assert cloud.probes == 0 and queue.get(i).attempts == 1
    clock.t += BREAKER_BACKOFF_S
    await loop.run_once()  # half-open: one probe, which fails
    assert cloud.probes == 1 and loop.breaker.state == "open" and queue.get(i).attempts == 1
    cloud.up = True
    clock.t += BREAKER_BACKOFF_S
    await loop.run_once()
    assert loop.breaker.state == "closed" and queue.get(i).state == State.DONE


@in_loop
async def test_run_recovers_what_a_dead_process_left_sending_and_wakes_on_notify(queue):
    (i,) = put(queue, "left")
    queue.claim(Kind.REQUEST, 1)  # a dead predecessor's claim
    cloud = Cloud()
    loop = make(queue, cloud)
    loop.config.poll_s = 30  # only notify() can wake it in time
    task = asyncio.create_task(loop.run())
    try:
        for _ in range(50):
            await asyncio.sleep(0.02)
            if queue.get(i).state == State.DONE:
                break
        assert queue.get(i).state == State.DONE
        (j,) = put(queue, "new")
        loop.notify()
        for _ in range(50):
            await asyncio.sleep(0.02)
            if queue.get(j).state == State.DONE:
                break
        assert queue.get(j).state == State.DONE
    finally:
        task.cancel()


@in_loop
async def test_callbacks_are_called_once_with_the_result(queue):
    (i,) = queue.enqueue_many([NewItem(Kind.REQUEST, {"q": "cb"}, endpoint="chat", callback_url="http://x/cb")])
    calls = []

    async def callback(item):
        calls.append((item.id, item.state, item.result))
        return len(calls) > 1  # the first call fails: retried

    loop = make(queue, Cloud())
    loop.callback = callback
    for _ in range(4):
        await loop.run_once()
    assert [c[0] for c in calls] == [i, i] and calls[0][1] == "done" and calls[0][2]["choices"]
    assert queue.pending_callbacks() == []


@in_loop
async def test_a_local_send_error_fails_that_item_and_never_the_breaker(queue, clock):
    bad, good = put(queue, "bad", "good")
    cloud = Cloud()
    sent = cloud.send

    async def send(item):
        if item.payload["q"] == "bad":
            raise UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogates not allowed")
        return await sent(item)

    loop = DeliveryLoop(queue, send, cloud.probe, CircuitBreaker(clock=clock), DeliveryConfig(poll_s=0.05))
    for _ in range(3):
        await loop.run_once()
    assert queue.get(bad).state == State.FAILED and queue.get(bad).result["error"]["code"] == "send_failed"
    assert queue.get(good).state == State.DONE
    assert loop.breaker.state == "closed" and loop.breaker.failures == 0


@in_loop
async def test_a_refused_key_is_the_refused_state_on_a_slow_schedule_and_says_so_on_what_waits(queue, clock):
    (i,) = put(queue, "x")
    cloud = Cloud(script=[401])
    breaker = CircuitBreaker(base_backoff_s=0.05, max_backoff_s=0.05, refused_backoff_s=30.0, clock=clock)
    loop = DeliveryLoop(queue, cloud.send, lambda: _refused_probe(), breaker, DeliveryConfig(poll_s=0.05,
                                                                                              base_backoff_s=0.0))
    await loop.run_once()
    assert breaker.state == "refused" and breaker.retry_after_s() == pytest.approx(30.0)
    assert queue.get(i).state == State.QUEUED and queue.get(i).attempts == 1
    clock.t += 30.0
    await loop.run_once()  # the probe is refused too: slower still, and the waiting item says why
    assert breaker.state == "refused" and breaker.retry_after_s() == pytest.approx(60.0)
    assert "refused" in queue.get(i).last_error and queue.get(i).attempts == 1


async def _refused_probe():
    return Outcome(401, error="refused: HTTP 401 (check [upstream] api_key)")


def test_outcomes_of_a_refused_device_and_a_local_error():
    assert Outcome(401).device_refused and Outcome(403).device_refused and Outcome(401).cloud_unavailable
    local = Outcome(0, local_error=True)
    assert local.refused and not local.cloud_unavailable and not local.delivered
