"""A rollout's states and each device's execution states, with the moves allowed between them
(AWS IoT Jobs' job and job execution). The strings are what the registry's database stores and
``cascade fleet rollout`` prints; a move the tables below do not hold is refused
(``IllegalMove``) before anything is written.

    rollout     RUNNING <-> PAUSED;  RUNNING | PAUSED -> SUCCEEDED | ROLLED_BACK | ABORTED;
                SUCCEEDED | ABORTED -> ROLLED_BACK (the operator's rollback after the fact)
    execution   QUEUED -> IN_PROGRESS (detail: the device's step) -> SUCCEEDED | FAILED | TIMED_OUT | REJECTED;
                QUEUED | IN_PROGRESS -> CANCELED (abort, rollback);  any told -> ROLLED_BACK (rollback)

What a device reports of its change (``DeviceState``, protocol/device_messages.py) ends an
execution only in the states ``REPORTED`` maps; its other steps keep it IN_PROGRESS.
"""

from __future__ import annotations

from enum import StrEnum

from model_distribution.protocol.device_messages import DeviceState


class IllegalMove(ValueError):
    """A state change the transition table refuses (a bug in the caller, never outside data)."""


class RolloutState(StrEnum):
    RUNNING = "RUNNING"
    PAUSED = "PAUSED"
    SUCCEEDED = "SUCCEEDED"  # every wave passed its gates
    ROLLED_BACK = "ROLLED_BACK"  # a gate failed, or the operator rolled it back
    ABORTED = "ABORTED"  # stopped by the operator where it was


class ExecutionState(StrEnum):
    QUEUED = "QUEUED"
    IN_PROGRESS = "IN_PROGRESS"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    TIMED_OUT = "TIMED_OUT"
    REJECTED = "REJECTED"
    CANCELED = "CANCELED"
    ROLLED_BACK = "ROLLED_BACK"


R, E = RolloutState, ExecutionState
ACTIVE_STATES = (R.RUNNING, R.PAUSED)  # one such rollout per group
DONE = (E.SUCCEEDED, E.FAILED, E.TIMED_OUT, E.REJECTED)  # executed: counted by the failure gate
FAILURES = (E.FAILED, E.TIMED_OUT, E.REJECTED)
RELEASED = (E.CANCELED, E.ROLLED_BACK)  # an execution in either no longer holds its device

ROLLOUT_MOVES: dict[RolloutState, frozenset[RolloutState]] = {
    R.RUNNING: frozenset({R.PAUSED, R.SUCCEEDED, R.ROLLED_BACK, R.ABORTED}),
    R.PAUSED: frozenset({R.RUNNING, R.SUCCEEDED, R.ROLLED_BACK, R.ABORTED}),
    R.SUCCEEDED: frozenset({R.ROLLED_BACK}),
    R.ABORTED: frozenset({R.ROLLED_BACK}),
    R.ROLLED_BACK: frozenset(),
}

EXECUTION_MOVES: dict[ExecutionState, frozenset[ExecutionState]] = {
    E.QUEUED: frozenset({E.IN_PROGRESS, E.CANCELED}),
    # IN_PROGRESS -> IN_PROGRESS: the device's next step (the detail changes, and when it was heard)
    E.IN_PROGRESS: frozenset({E.IN_PROGRESS, *DONE, E.CANCELED, E.ROLLED_BACK}),
    **{done: frozenset({E.ROLLED_BACK}) for done in DONE},
    E.CANCELED: frozenset({E.ROLLED_BACK}),  # an abort canceled it after it was told: a rollback sends it back
    E.ROLLED_BACK: frozenset(),
}

# a device's final word on its change -> its execution's state
REPORTED: dict[DeviceState, ExecutionState] = {
    DeviceState.ACTIVE: E.SUCCEEDED,
    DeviceState.FAILED: E.FAILED,
    DeviceState.REJECTED: E.REJECTED,
}


def check_rollout_move(current: str, new: str) -> RolloutState:
    """``new`` as a RolloutState, if a rollout in ``current`` may move there; IllegalMove otherwise."""
    return _check(RolloutState, ROLLOUT_MOVES, "rollout", current, new)


def check_execution_move(current: str, new: str) -> ExecutionState:
    """``new`` as an ExecutionState, if an execution in ``current`` may move there; IllegalMove otherwise."""
    return _check(ExecutionState, EXECUTION_MOVES, "execution", current, new)


def _check(kind: type[StrEnum], moves: dict, what: str, current: str, new: str):
    try:
        src, dst = kind(current), kind(new)
    except ValueError:
        raise IllegalMove(f"{what} state {current!r} -> {new!r}: not a {kind.__name__} "
                          f"(one of {', '.join(kind)})") from None
    if dst not in moves[src]:
        allowed = ", ".join(sorted(moves[src])) or "none: it is final"
        raise IllegalMove(f"{what} cannot move from {src} to {dst} (from {src}: {allowed})")
    return dst
