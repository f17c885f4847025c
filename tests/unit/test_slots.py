import asyncio

import pytest

from edge_agent.server.slots import SlotPool, TooManyWaiting


def run(coro):
    return asyncio.run(coro)


def test_free_slot_is_given_at_once_then_requests_wait_in_order():
    async def scenario():
        pool = SlotPool(["s0"], max_waiting=2)
        first = pool.reserve()
        assert first.done() and first.result() == "s0"
        second, third = pool.reserve(), pool.reserve()
        assert pool.waiting == 2 and not second.done()
        pool.release("s0")
        assert await second == "s0" and not third.done()
        pool.release("s0")
        assert await third == "s0"
        pool.release("s0")
        assert pool.busy == 0 and pool.waiting == 0
    run(scenario())


def test_full_queue_refuses_with_a_retry_estimate():
    async def scenario():
        pool = SlotPool(["s0"], max_waiting=1)
        pool.reserve()
        pool.reserve()
        pool.release("s0", held_s=4.0)  # mean service time moves toward 4 s
        pool.reserve()
        with pytest.raises(TooManyWaiting) as e:
            pool.reserve()
        assert e.value.retry_after_s > 0
    run(scenario())


def test_giving_up_leaves_the_line_or_returns_the_slot():
    async def scenario():
        pool = SlotPool(["s0"], max_waiting=4)
        held = pool.reserve()
        waiting = pool.reserve()
        pool.cancel(waiting)
        assert pool.waiting == 0
        pool.cancel(held)  # was granted, never used: back to the pool
        assert pool.busy == 0
        assert pool.reserve().result() == "s0"
    run(scenario())
