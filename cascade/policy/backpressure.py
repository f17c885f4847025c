"""Cloud back-pressure: a circuit breaker. A 429 or an unreachable cloud opens it (until the
Retry-After, or a backoff); while open the agent serves locally, marked degraded, instead of
queueing behind the cloud. After that time one probe goes through; a success closes it. The
gateway keeps one per worker, opened only after ``threshold`` failures in a row.

A refusal of this device (401/403: a wrong or revoked key) is a state of its own, ``refused``:
the cloud is up but will not serve us, which no amount of quick retrying changes, so it is
tried again on a slow schedule (``refused_backoff_s``, doubling) and reported as what it is."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from email.utils import parsedate_to_datetime

MAX_RETRY_AFTER_S = 3600.0  # a peer's Retry-After is honoured up to this (a typo must not park us for days)
MAX_REFUSED_BACKOFF_S = 600.0  # a refused device asks again after refused_backoff_s, doubling up to this
_MAX_DOUBLINGS = 30  # 2**30 * any base is past every cap: no overflow after a long outage


def exponential_backoff_s(failures: int, base_s: float, max_s: float) -> float:
    """``base_s * 2**(failures - 1)``, capped at ``max_s``; finite for any number of failures."""
    return min(max_s, base_s * 2.0 ** min(max(failures - 1, 0), _MAX_DOUBLINGS))


def clamp_retry_after(seconds: float | None, limit_s: float = MAX_RETRY_AFTER_S) -> float | None:
    """A wait a peer asked for, made safe: None for NaN, at least 0, at most ``limit_s``."""
    if seconds is None or math.isnan(seconds):
        return None
    return min(max(seconds, 0.0), limit_s)


def parse_retry_after(value: str | None, now: float | None = None,
                      limit_s: float = MAX_RETRY_AFTER_S) -> float | None:
    """An HTTP ``Retry-After`` in seconds: delta-seconds or an HTTP-date (RFC 9110), clamped;
    None when absent or unreadable. ``now`` is the wall clock (``time.time()``) for a date."""
    if value is None:
        return None
    value = value.strip()
    try:
        return clamp_retry_after(float(value), limit_s)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT; a peer that left the zone out means it too
        return None
    return clamp_retry_after(when.timestamp() - (time.time() if now is None else now), limit_s)


@dataclass
class CircuitBreaker:
    base_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    open_until: float = 0.0
    failures: int = 0
    probing: bool = False
    refused_backoff_s: float = 30.0
    max_retry_after_s: float = MAX_RETRY_AFTER_S
    refused: bool = False  # the last failure was the cloud refusing this device (401/403)
    last_error: str = ""
    threshold: int = 1  # failures in a row before it opens (the gateway's breaker per worker: 3)
    # the two schedules count apart: an outage's failures must not lengthen the wait after the
    # cloud, answering again, refuses the key (nor refusals the wait after a failure)
    refusals: int = 0  # refusals since the last success
    outage_failures: int = 0  # failures (no answer, 5xx, 429) since the cloud last answered

    @property
    def state(self) -> str:
        """closed | open | half_open | refused (open because the cloud refused this device)."""
        if self.failures < self.threshold and not self.refused:
            return "closed"
        if self.clock() < self.open_until:
            return "refused" if self.refused else "open"
        return "half_open"

    @property
    def available(self) -> bool:
        """Whether a request may go now: closed, or half-open with no probe in flight."""
        s = self.state
        return s == "closed" or (s == "half_open" and not self.probing)

    def allow(self) -> bool:
        """May a request go to the cloud now? In half-open state, only one probe at a time."""
        s = self.state
        if s == "closed":
            return True
        if s == "open" or self.probing:
            return False
        self.probing = True
        return True

    def success(self) -> None:
        self.failures, self.open_until, self.probing, self.refused, self.last_error = 0, 0.0, False, False, ""
        self.refusals = self.outage_failures = 0

    def failure(self, error: str, retry_after_s: float | None = None) -> None:
        self.outage_failures += 1
        self._open(error, retry_after_s, self.base_backoff_s, self.max_backoff_s, refused=False,
                   n=self.outage_failures)

    def refusal(self, error: str, retry_after_s: float | None = None) -> None:
        """The cloud refused this device (401/403): open, on the slow schedule (``refused_backoff_s``
        doubling per refusal, whatever failures came before the cloud answered)."""
        self.refusals += 1
        self.outage_failures = 0  # it answered
        self._open(error, retry_after_s, self.refused_backoff_s,
                   max(MAX_REFUSED_BACKOFF_S, self.max_backoff_s, self.refused_backoff_s), refused=True,
                   n=self.refusals)

    def abandon(self) -> None:
        """A request let through ended without telling anything (cancelled): free the probe slot
        so the next caller probes, without counting a failure or a success."""
        self.probing = False

    def _open(self, error: str, retry_after_s: float | None, base_s: float, max_s: float, refused: bool,
              n: int) -> None:
        """``n``: the count (of its kind) this failure's backoff doubles with."""
        self.failures += 1
        self.probing = False
        self.refused = refused
        self.last_error = error
        if self.failures < self.threshold and not refused:
            return  # not yet
        backoff = exponential_backoff_s(n if refused else n - self.threshold + 1, base_s, max_s)
        retry_after_s = clamp_retry_after(retry_after_s, self.max_retry_after_s)
        self.open_until = self.clock() + (max(retry_after_s, base_s if refused else 0.0)
                                          if retry_after_s is not None else backoff)

    def retry_after_s(self) -> float:
        return max(0.0, self.open_until - self.clock())
