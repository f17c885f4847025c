"""A bounded wait for a free backend slot: admission is decided at once (429 when the queue is
full), the wait itself is cancellable, and a slot goes back only when its generation ended."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

T = TypeVar("T")


class TooManyWaiting(Exception):
    def __init__(self, retry_after_s: float):
        super().__init__("the local queue is full")
        self.retry_after_s = retry_after_s


class SlotPool(Generic[T]):
    """``parallel`` slots, at most ``max_waiting`` requests waiting for one, FIFO."""

    def __init__(self, slots: list[T], max_waiting: int):
        self._free: deque[T] = deque(slots)
        self._waiters: deque[asyncio.Future[T]] = deque()
        self.size = len(slots)
        self.max_waiting = max_waiting
        self.mean_service_s = 2.0  # moving average of how long a request holds a slot

    @property
    def busy(self) -> int:
        return self.size - len(self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def free_slots(self) -> list[T]:
        """The slots not in use now (all of them once the pool is idle)."""
        return list(self._free)

    def predicted_wait_s(self) -> float:
        """How long a request arriving now would wait for a slot."""
        if self._free:
            return 0.0
        return self.mean_service_s * (self.waiting + 1) / self.size

    def reserve(self) -> asyncio.Future[T]:
        """A place in line, decided now: a future that resolves to a slot (at once if one is
        free). Raises TooManyWaiting when ``max_waiting`` requests already wait. The caller awaits
        the future and, if it gives up, calls ``cancel`` with it."""
        fut: asyncio.Future[T] = asyncio.get_running_loop().create_future()
        if self._free and not self._waiters:
            fut.set_result(self._free.popleft())
            return fut
        if len(self._waiters) >= self.max_waiting:
            raise TooManyWaiting(self.predicted_wait_s())
        self._waiters.append(fut)
        return fut

    def cancel(self, fut: asyncio.Future[T]) -> None:
        """Give up a reservation: leave the line, or hand back the slot it already got."""
        if fut.done() and not fut.cancelled():
            self.release(fut.result())
        else:
            fut.cancel()
            if fut in self._waiters:
                self._waiters.remove(fut)

    def release(self, slot: T, held_s: float | None = None) -> None:
        if held_s is not None:
            self.mean_service_s = 0.8 * self.mean_service_s + 0.2 * held_s
        while self._waiters:
            fut = self._waiters.popleft()
            if not fut.done():
                fut.set_result(slot)
                return
        self._free.append(slot)
