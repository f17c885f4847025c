"""A batch's state machine, as OpenAI's Batch object states it:

    validating -> in_progress -> finalizing -> completed
    validating -> failed                    (the input file is not a valid batch)
    validating | in_progress -> cancelling -> cancelled
    validating | in_progress -> expired     (completion_window passed)

Each state but validating has its own timestamp field (``in_progress_at`` ...). ``next_status``
says where a batch goes from what its lines show; pure, so the runner and tests share it."""

from __future__ import annotations

import re
from enum import StrEnum


class Status(StrEnum):
    VALIDATING = "validating"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"
    EXPIRED = "expired"

    @property
    def timestamp_field(self) -> str | None:
        return None if self is Status.VALIDATING else f"{self.value}_at"

    @property
    def final(self) -> bool:
        return self in (Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.EXPIRED)


TRANSITIONS: dict[Status, frozenset[Status]] = {
    Status.VALIDATING: frozenset({Status.IN_PROGRESS, Status.FAILED, Status.CANCELLING, Status.EXPIRED}),
    Status.IN_PROGRESS: frozenset({Status.FINALIZING, Status.CANCELLING, Status.EXPIRED}),
    Status.FINALIZING: frozenset({Status.COMPLETED}),
    Status.CANCELLING: frozenset({Status.CANCELLED}),
    Status.COMPLETED: frozenset(),
    Status.FAILED: frozenset(),
    Status.CANCELLED: frozenset(),
    Status.EXPIRED: frozenset(),
}
CANCELLABLE = frozenset({Status.VALIDATING, Status.IN_PROGRESS})


class InvalidTransition(ValueError):
    pass


def check_transition(current: Status, new: Status) -> None:
    if new not in TRANSITIONS[current]:
        raise InvalidTransition(f"a batch cannot go from {current} to {new}")


def next_status(status: Status, pending: int, running: int, now: float, expires_at: float) -> Status | None:
    """Where a validated batch goes next (None: it stays), given its lines not started and in
    flight. Expiry comes first: unfinished lines then end as ``batch_expired`` errors."""
    if status is Status.IN_PROGRESS:
        if now >= expires_at and pending + running:
            return Status.EXPIRED
        return Status.FINALIZING if pending + running == 0 else None
    if status is Status.CANCELLING:
        return Status.CANCELLED if running == 0 else None
    if status is Status.FINALIZING:
        return Status.COMPLETED
    return None


_WINDOW = re.compile(r"([1-9][0-9]*)([smh])")
MAX_WINDOW_S = 24 * 3600


def window_seconds(window: str) -> int:
    """``completion_window`` in seconds: OpenAI's "24h", or any shorter "<n>s|m|h" (ours)."""
    m = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    seconds = int(m[1]) * {"s": 1, "m": 60, "h": 3600}[m[2]] if m else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise ValueError(f"completion_window must be '24h' (or a shorter '<n>s', '<n>m', '<n>h'), not {window!r}")
    return seconds
