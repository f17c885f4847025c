"""A passive circuit breaker per worker: failures the gateway sees on real requests (connect
errors, 5xx, a first token that never came) open it after ``threshold`` in a row; an open breaker
sends the worker nothing for ``open_s`` (doubling while it keeps failing, up to ``max_open_s``);
then one trial request is let through (half-open), whose success closes it again."""

from __future__ import annotations

import time
from collections.abc import Callable


class CircuitBreaker:
    def __init__(self, threshold: int = 3, open_s: float = 5.0, max_open_s: float = 60.0,
                 clock: Callable[[], float] = time.monotonic):
        if threshold < 1 or open_s <= 0 or max_open_s < open_s:
            raise ValueError("need threshold >= 1 and 0 < open_s <= max_open_s")
        self.threshold = threshold
        self.base_open_s = open_s
        self.max_open_s = max_open_s
        self._clock = clock
        self.failures = 0  # in a row
        self.opened_at: float | None = None
        self.open_s = open_s
        self.trial = False  # a half-open trial request is out

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self._clock() >= self.opened_at + self.open_s else "open"

    def allows(self) -> bool:
        """Whether a request may go to the worker now (without taking the half-open trial)."""
        s = self.state
        return s == "closed" or (s == "half_open" and not self.trial)

    def take(self) -> None:
        """A request is sent: in half-open, it is the one trial."""
        if self.state == "half_open":
            self.trial = True

    def success(self) -> None:
        self.failures, self.opened_at, self.open_s, self.trial = 0, None, self.base_open_s, False

    def failure(self) -> None:
        self.failures += 1
        if self.opened_at is not None and self.trial:  # the trial failed: open again, for longer
            self.open_s = min(self.open_s * 2, self.max_open_s)
            self.opened_at, self.trial = self._clock(), False
        elif self.opened_at is None and self.failures >= self.threshold:
            self.opened_at = self._clock()
