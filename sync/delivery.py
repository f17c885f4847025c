"""Store-and-forward: the loop that empties the outbox into the cloud when it can be reached.

Each round claims a batch of requests (the head of each session, so a session's order holds
while different sessions go out side by side), sends them at once, and records every outcome in
one transaction: the response into the inbox (``done``), a refusal as ``failed``, a passing
failure back to ``queued`` with exponential backoff and jitter. Whether the cloud can be reached
is learnt from these real attempts, kept in the circuit breaker the cascade's back-pressure
shares: while it is open nothing is sent; when its time is up one cheap probe decides.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from cascade.policy.backpressure import CircuitBreaker, exponential_backoff_s
from sync.queue import Item, Kind, OfflineQueue

log = logging.getLogger(__name__)

# answers that say nothing about the request itself: send it again later
_PASSING = {408, 409, 425, 429}
# answers that say the cloud (or this device's access to it) is not usable now
_UNAVAILABLE = {401, 403, 404, 429}
# of those, the cloud refusing this device (a wrong or revoked key): the breaker's refused state
_REFUSED = {401, 403}


@dataclass
class Outcome:
    """What one delivery attempt got: an HTTP status (0: no answer) and the response body."""

    status: int
    body: Any = None
    retry_after_s: float | None = None
    error: str = ""

    local_error: bool = False  # this device could not send it (its own bug, an unencodable body)

    @property
    def delivered(self) -> bool:
        return 200 <= self.status < 300

    @property
    def refused(self) -> bool:
        """The cloud looked at the request and said no for good (a 4xx about the request), or
        this device cannot send it at all: either way it is ``failed``, not tried again."""
        return self.local_error or (400 <= self.status < 500 and self.status not in _PASSING | _UNAVAILABLE)

    @property
    def cloud_unavailable(self) -> bool:
        return not self.local_error and (self.status == 0 or self.status >= 500 or self.status in _UNAVAILABLE)

    @property
    def device_refused(self) -> bool:
        return self.status in _REFUSED


@dataclass
class DeliveryConfig:
    batch_size: int = 16  # items claimed and sent together
    base_backoff_s: float = 0.5  # an item's n-th failed attempt waits base * 2**(n-1), jittered
    max_backoff_s: float = 60.0
    poll_s: float = 5.0  # longest idle wait (an enqueue wakes the loop at once)
    lease_s: float = 120.0  # a claimed item returns to the queue if not settled by then
    callback_attempts: int = 3


def backoff_s(attempts: int, config: DeliveryConfig, rng: random.Random = random._inst) -> float:
    """Exponential backoff with "equal jitter": half fixed, half random, capped."""
    ceiling = exponential_backoff_s(attempts, config.base_backoff_s, config.max_backoff_s)
    return ceiling / 2 + rng.uniform(0, ceiling / 2)


class DeliveryLoop:
    def __init__(self, queue: OfflineQueue, send: Callable[[Item], Awaitable[Outcome]],
                 probe: Callable[[], Awaitable[bool]], breaker: CircuitBreaker,
                 config: DeliveryConfig | None = None,
                 callback: Callable[[Item], Awaitable[bool]] | None = None):
        self.queue = queue
        self.send, self.probe = send, probe
        self.breaker = breaker
        self.config = config or DeliveryConfig()
        self.callback = callback
        self.delivered = self.failed = self.retried = 0
        self._wake = asyncio.Event()
        self._callback_tries: dict[str, int] = {}
        self._last_collect = self._last_expire = 0.0
        self._noted = ""  # the circuit's error last written on what waits
        self._queued_since_noted = False

    def notify(self) -> None:
        """Something was queued: look now rather than at the next poll."""
        self._queued_since_noted = True
        self._wake.set()

    async def run(self) -> None:
        """Deliver until cancelled. Whatever a dead predecessor left ``sending`` is queued again first."""
        n = await asyncio.to_thread(self.queue.recover)
        if n:
            log.info("%d item(s) left in flight by an earlier run are queued again", n)
        while True:
            try:
                wait = await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bad round must not end delivery: log it, wait, go on
                log.exception("delivery round failed")
                wait = self.config.poll_s
            if wait > 0:
                self._wake.clear()
                try:
                    await asyncio.wait_for(self._wake.wait(), wait)
                except TimeoutError:
                    pass

    async def run_once(self) -> float:
        """One round: probe or send one batch, run callbacks. Returns how long to wait before the next."""
        if self.callback is not None:
            await self._callbacks()
        now = time.time()
        if now - self._last_expire >= 1.0:  # TTLs run out while the cloud is away too
            self._last_expire = now
            await asyncio.to_thread(self.queue.expire)
        if now - self._last_collect > 60:
            self._last_collect = now
            await asyncio.to_thread(self.queue.collect)
        if not self.breaker.allow():
            await self._say_why_waiting()
            return max(0.05, min(self.breaker.retry_after_s(), self.config.poll_s, 1.0))
        if self.breaker.probing:  # half-open: this round's one attempt is a cheap probe
            if not await self._probe():
                return max(0.05, min(self.breaker.retry_after_s(), self.config.poll_s))
        batch = await asyncio.to_thread(self.queue.claim, Kind.REQUEST, self.config.batch_size, self.config.lease_s)
        if not batch:
            due = await asyncio.to_thread(self.queue.next_due, Kind.REQUEST)
            return self.config.poll_s if due is None else min(self.config.poll_s, max(0.0, due - time.time()))
        outcomes = await asyncio.gather(*(self._attempt(it) for it in batch))
        settled = [(item.id, out.status, out.body, not out.delivered)
                   for item, out in zip(batch, outcomes, strict=True) if out.delivered or out.refused]
        await asyncio.to_thread(self.queue.complete_many, settled)
        log.debug("delivery round: %d sent, %d delivered, %d refused, %d to retry", len(batch),
                  sum(o.delivered for o in outcomes), sum(o.refused for o in outcomes),
                  sum(not (o.delivered or o.refused) for o in outcomes))
        for item_id, status, _, refused in settled:  # counted once recorded
            if refused:
                self.failed += 1
                log.warning("queued request %s refused by the cloud (%d)", item_id, status)
            else:
                self.delivered += 1
        for item, out in zip(batch, outcomes, strict=True):
            if not (out.delivered or out.refused):
                self.retried += 1
                delay = max(backoff_s(item.attempts, self.config), out.retry_after_s or 0.0)
                await asyncio.to_thread(self.queue.retry_later, item.id, out.error or f"HTTP {out.status}", delay)
        if any(o.cloud_unavailable for o in outcomes):
            worst = next((o for o in outcomes if o.device_refused), None) or next(
                o for o in outcomes if o.cloud_unavailable)
            self._unavailable(worst)
        elif any(o.delivered or (o.refused and not o.local_error) for o in outcomes):
            self.breaker.success()
        return 0.0

    async def _attempt(self, item: Item) -> Outcome:
        try:
            return await self.send(item)
        except Exception as e:  # our own failure to send it says nothing about the cloud: that item fails
            log.exception("queued request %s could not be sent", item.id)
            return Outcome(0, {"error": {"message": f"this device could not send the request: {e!r}",
                                         "type": "local_error", "param": None, "code": "send_failed"}},
                           error=repr(e), local_error=True)

    async def _probe(self) -> bool:
        """One cheap probe (``probe`` answers an Outcome, or a bool) settles the half-open breaker."""
        try:
            out = await self.probe()
        except Exception as e:
            out = Outcome(0, error=repr(e))
        if isinstance(out, bool):
            out = Outcome(200) if out else Outcome(0, error="probe failed")
        if out.delivered:
            self.breaker.success()
            return True
        self._unavailable(out)
        await self._say_why_waiting()
        return False

    async def _say_why_waiting(self) -> None:
        """While the circuit is open, the queued requests carry its error (what `cascade edge queue
        list` shows): written when the error changes or something was queued since."""
        error = self.breaker.last_error
        if error and (error != self._noted or self._queued_since_noted):
            self._noted, self._queued_since_noted = error, False
            await asyncio.to_thread(self.queue.note_error, Kind.REQUEST, error)

    def _unavailable(self, out: Outcome) -> None:
        error = out.error or f"HTTP {out.status}"
        if out.device_refused:
            if not self.breaker.refused:
                log.error("the cloud refuses this device (HTTP %d): check [upstream] api_key; queued requests "
                          "wait and are tried again on a slow schedule: %s", out.status, error)
            self.breaker.refusal(error, out.retry_after_s)
        else:
            self.breaker.failure(error, out.retry_after_s)

    async def _callbacks(self) -> None:
        for item in await asyncio.to_thread(self.queue.pending_callbacks):
            try:
                ok = await self.callback(item)
            except Exception as e:
                log.warning("callback for %s to %s failed: %r", item.id, item.callback_url, e)
                ok = False
            tries = self._callback_tries.get(item.id, 0) + 1
            if ok or tries >= self.config.callback_attempts:
                self._callback_tries.pop(item.id, None)
                await asyncio.to_thread(self.queue.callback_done, item.id, ok)
            else:
                self._callback_tries[item.id] = tries
