"""The device's delivery loop across a cloud outage (issue 37 items 15 and 17): the wait after a
refused key follows refused_backoff_s doubling whatever the outage counted, and what waits in the
queue says why it waits. A real SQLite queue; the cloud's faults are scripted, the clock is fake."""

from __future__ import annotations

import asyncio

import pytest

from cascade.policy.backpressure import CircuitBreaker
from sync.delivery import DeliveryConfig, DeliveryLoop, Outcome
from sync.queue import Kind, NewItem, OfflineQueue
from tests.unit.sync.fakes import FakeClock


class Cloud:
    """Down (no answer) until told otherwise; then up but refusing this device's key."""

    def __init__(self):
        self.state = "down"

    async def send(self, item) -> Outcome:
        return await self.probe()

    async def probe(self) -> Outcome:
        if self.state == "down":
            return Outcome(0, error="unreachable: ConnectError('connection refused')")
        return Outcome(401, error="refused: HTTP 401 (check [upstream] api_key)")


@pytest.fixture
def queue(tmp_path):
    q = OfflineQueue(tmp_path / "q.db", synchronous="NORMAL")
    yield q
    q.close()


def loop_with(queue, cloud: Cloud, clock: FakeClock) -> DeliveryLoop:
    # the agent's defaults: [upstream] max_backoff_s 60, refused_backoff_s 30
    breaker = CircuitBreaker(base_backoff_s=1.0, max_backoff_s=60.0, refused_backoff_s=30.0, clock=clock)
    return DeliveryLoop(queue, cloud.send, cloud.probe, breaker, DeliveryConfig(poll_s=0.05))


async def through_the_outage(loop: DeliveryLoop, clock: FakeClock, rounds: int) -> None:
    for _ in range(rounds):
        clock.t += loop.breaker.retry_after_s()
        await loop.run_once()


def test_the_first_refusal_after_an_outage_waits_refused_backoff_s_then_doubles(queue):
    async def main():
        clock, cloud = FakeClock(), Cloud()
        queue.enqueue_many([NewItem(Kind.REQUEST, {"q": 1}, endpoint="chat")])
        loop = loop_with(queue, cloud, clock)
        await through_the_outage(loop, clock, 8)
        assert loop.breaker.state == "open" and loop.breaker.retry_after_s() == pytest.approx(60.0)
        cloud.state = "refusing"
        await through_the_outage(loop, clock, 1)
        assert loop.breaker.state == "refused" and loop.breaker.retry_after_s() == pytest.approx(30.0)
        await through_the_outage(loop, clock, 1)
        assert loop.breaker.retry_after_s() == pytest.approx(60.0)
        cloud.state = "down"  # and the network goes again: its own schedule starts over
        await through_the_outage(loop, clock, 1)
        assert loop.breaker.state == "open" and loop.breaker.retry_after_s() == pytest.approx(1.0)

    asyncio.run(main())


def test_what_waits_through_an_outage_says_why(queue):
    """Queued after the live escalation found the cloud away (its circuit open): never sent, but
    `cascade edge queue list` shows the error it waits on."""
    async def main():
        clock, cloud = FakeClock(), Cloud()
        loop = loop_with(queue, cloud, clock)
        loop.breaker.failure("unreachable: ConnectError('connection refused')")  # the escalation's failure
        (item,) = queue.enqueue_many([NewItem(Kind.REQUEST, {"q": 1}, endpoint="chat")])
        loop.notify()
        await loop.run_once()
        assert "unreachable" in queue.get(item).last_error
        await through_the_outage(loop, clock, 3)  # probes fail
        assert queue.get(item).attempts == 0 and "unreachable" in queue.get(item).last_error

    asyncio.run(main())
