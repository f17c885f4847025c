"""Store-and-forward: the loop that empties the outbox into the cloud when it can be reached.

Each round claims a batch of requests (the head of each session, so a session's order holds
while different sessions go out side by side), sends them at once, and records every outcome in
one transaction: the response into the inbox (``done``), a refusal as ``failed``, a passing
failure back to ``queued`` with exponential backoff and jitter. Whether the cloud can be reached
is learnt from these real attempts, kept in the circuit breaker the cascade's back-pressure
shares: while it is open nothing is sent; when its time is up one cheap probe decides.

Two kinds of failure are told apart. Signs that the cloud is down (no answer, a timeout, 429,
502/503/504, an answer that is not an OpenAI one) open the circuit and never count against the
item: it waits, up to its TTL. A failure of the request's own (a 500 or 404 with an OpenAI error
body) leaves the circuit closed, other requests go on, and counts against that item: after
``max_attempts`` of them it ends ``failed`` with its last error, and the next request of its
session goes out.
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

# the request is being run already (its Idempotency-Key in flight): ask again later, nothing learnt
_PASSING = {409, 425}
# signs that the cloud is down or overloaded (0: no answer at all): the circuit opens
_DOWN = {0, 408, 429, 502, 503, 504}
# the cloud refusing this device (a wrong or revoked key): the breaker's refused state
_REFUSED = {401, 403}
# 4xx that are not a refusal of the request for good (it is sent again)
_AGAIN = _PASSING | _DOWN | _REFUSED | {404}


def openai_error(body: Any) -> bool:
    """Whether ``body`` is an OpenAI error answer: ``{"error": {"message", "type", "code"|"param"}}``
    (or vLLM's older flat form with ``"object": "error"``): the cloud itself said it."""
    err = body if isinstance(body, dict) and body.get("object") == "error" else (
        body.get("error") if isinstance(body, dict) else None)
    return (isinstance(err, dict) and isinstance(err.get("message"), str) and "type" in err
            and ("code" in err or "param" in err))


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
        return self.local_error or (400 <= self.status < 500 and self.status not in _AGAIN)

    @property
    def cloud_unavailable(self) -> bool:
        """A sign that the cloud is down, or refuses this device: the circuit opens."""
        if self.local_error or self.delivered or self.refused or self.status in _PASSING:
            return False
        return self.status in _DOWN | _REFUSED or not openai_error(self.body)

    @property
    def own_failure(self) -> bool:
        """A failure of this request's own (the cloud answered, and not about being down):
        counted against the item, up to ``max_attempts``."""
        return not (self.delivered or self.refused) and self.status not in _DOWN | _REFUSED | _PASSING

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
    max_attempts: int = 8  # failures of a request's own (Outcome.own_failure) before it ends failed

    def __post_init__(self):
        if self.max_attempts < 1:
            raise ValueError("max_attempts must be >= 1")


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
        settled = [(item.id, out.status, out.body, not out.delivered, out.error or f"HTTP {out.status}")
                   for item, out in zip(batch, outcomes, strict=True) if out.delivered or out.refused]
        settled += [(item.id, out.status, out.body, True,
                     f"failed {item.failures + 1} times: {out.error or f'HTTP {out.status}'}")
                    for item, out in zip(batch, outcomes, strict=True) if self._gives_up(item, out)]
        await asyncio.to_thread(self.queue.complete_many, settled)
        log.debug("delivery round: %d sent, %d delivered, %d refused, %d to retry", len(batch),
                  sum(o.delivered for o in outcomes), sum(o.refused for o in outcomes),
                  sum(not (o.delivered or o.refused) for o in outcomes))
        for item_id, status, _, failed, error in settled:  # counted once recorded
            if failed:
                self.failed += 1
                log.warning("queued request %s failed (%d): %s", item_id, status, error[:200])
            else:
                self.delivered += 1
        for item, out in zip(batch, outcomes, strict=True):
            if not (out.delivered or out.refused or self._gives_up(item, out)):
                self.retried += 1
                delay = max(backoff_s(item.attempts, self.config), out.retry_after_s or 0.0)
                await asyncio.to_thread(self.queue.retry_later, item.id, out.error or f"HTTP {out.status}", delay,
                                        out.own_failure)
        if any(o.cloud_unavailable for o in outcomes):
            worst = next((o for o in outcomes if o.device_refused), None) or next(
                o for o in outcomes if o.cloud_unavailable)
            self._unavailable(worst)
        elif any(o.delivered or (not o.local_error and (o.refused or o.own_failure)) for o in outcomes):
            self.breaker.success()  # the cloud answered about the request itself: it is up
        return 0.0

    def _gives_up(self, item: Item, out: Outcome) -> bool:
        """This failure of the item's own is its ``max_attempts``-th: it ends failed."""
        return out.own_failure and not out.local_error and item.failures + 1 >= self.config.max_attempts

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
