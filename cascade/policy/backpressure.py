"""Cloud back-pressure: a circuit breaker. A 429 or an unreachable cloud opens it (until the
Retry-After, or a backoff); while open the agent serves locally, marked degraded, instead of
queueing behind the cloud. After that time one probe goes through; a success closes it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass
class CircuitBreaker:
    base_backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    clock: Callable[[], float] = time.monotonic
    open_until: float = 0.0
    failures: int = 0
    probing: bool = False
    last_error: str = ""

    @property
    def state(self) -> str:
        if self.failures == 0:
            return "closed"
        return "open" if self.clock() < self.open_until else "half_open"

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
        self.failures, self.open_until, self.probing, self.last_error = 0, 0.0, False, ""

    def failure(self, error: str, retry_after_s: float | None = None) -> None:
        self.failures += 1
        self.probing = False
        self.last_error = error
        backoff = min(self.max_backoff_s, self.base_backoff_s * 2 ** (self.failures - 1))
        self.open_until = self.clock() + (retry_after_s if retry_after_s is not None else backoff)

    def retry_after_s(self) -> float:
        return max(0.0, self.open_until - self.clock())
