"""How an execution follows what its device reports of its assignment (typed: the stored
report read back as protocol.device_messages.ReportedState). A device's final word (states.REPORTED)
ends it; its other steps keep it IN_PROGRESS and count as word only when they say something new.
WAITING, for its window, is IN_PROGRESS: the device says so again every minute, its heartbeat,
which counts as word only until its window should have opened: at most a day for HH:MM-HH:MM, at
most DAYS_TO_OPEN for a cron window.
"""

from __future__ import annotations

from model_distribution.protocol.device_messages import DeviceState, ReportedState
from model_distribution.rollout.spec import Execution, Rollout
from model_distribution.rollout.states import REPORTED
from model_distribution.rollout.states import ExecutionState as E
from model_distribution.rollout.store import RolloutStore


def follow(e: Execution, report: ReportedState | None, r: Rollout, rollouts: RolloutStore, now: float) -> None:
    """An execution follows its device's report of this assignment (its revision or a later one);
    one that has made no progress for the step timeout is TIMED_OUT (a heartbeat: a report counts
    as word only when it says something new, a new step or a download further on, so a device
    repeating "DOWNLOADING 1%" times out; WAITING for its window counts only until the window
    should have opened). A FAILED the device will try again (``retry``: the network, a full disk, a control
    plane restarting) is not final: the execution stays IN_PROGRESS until the step timeout."""
    rep = report or ReportedState()
    ours = rep.desired == r.ref and rep.rev is not None and e.desired_rev is not None and rep.rev >= e.desired_rev
    new = ours and rep.at is not None and rep.at != e.report_at
    retrying = rep.state == DeviceState.FAILED and rep.retry is True  # a cut download: it tries again
    quiet_for = now - max(e.updated_at, e.heard_at or 0)
    if ours and rep.state in REPORTED and not retrying:
        if rep.state == DeviceState.ACTIVE and rep.model not in (None, r.ref):
            return  # it says it runs another version: not this one done (the step timeout decides)
        rollouts.move(e, REPORTED[rep.state], rep.reason and rep.reason[:500], now, report_at=rep.at if new else None)
    elif new and retrying:  # still under way, but only progress counts as word: the clock stays where it was
        rollouts.move(e, E.IN_PROGRESS, f"retrying: {rep.reason}"[:500], max(e.updated_at, e.heard_at or 0),
                      report_at=rep.at)
    elif new and rep.state == DeviceState.WAITING:
        until = e.wait_until
        if until is None:  # the first word that it waits: its window opens within a bound the spec sets
            longest = max_wait_s(r.spec.window)
            until = now + min(rep.wait_s if rep.wait_s is not None else longest, longest)
        if now <= until:
            rollouts.move(e, E.IN_PROGRESS, "WAITING for its window", now, report_at=rep.at, wait_until=until)
        elif quiet_for > r.spec.step_timeout_s:
            rollouts.move(e, E.TIMED_OUT, f"still WAITING {now - until:.0f} s after its window should have opened", now)
    elif new and (detail := _detail(rep)) != e.detail:  # progress: a new step, or further in the download
        rollouts.move(e, E.IN_PROGRESS, detail, now, report_at=rep.at)
    elif quiet_for > r.spec.step_timeout_s:  # no word, or the same word again ("DOWNLOADING 1%" every second)
        rollouts.move(e, E.TIMED_OUT, f"no word for {r.spec.step_timeout_s:.0f} s ({e.detail})", now)


def _detail(rep: ReportedState) -> str:
    """What an execution shows of a device's report: its state, and how far a download is."""
    if rep.state == DeviceState.DOWNLOADING and rep.total and rep.done is not None:
        return f"DOWNLOADING {min(100, 100 * rep.done // rep.total)}%"
    return str(rep.state)[:40]


def max_wait_s(window: str | None) -> float:
    """The longest a device may wait for ``window`` to open: a day for HH:MM-HH:MM, DAYS_TO_OPEN
    days for a cron window (what the spec's check lets through), nothing without a window."""
    from model_distribution.protocol.windows import DAYS_TO_OPEN

    if not window:
        return 0.0
    return 86400.0 if ":" in window and "-" in window and len(window.split()) == 1 else DAYS_TO_OPEN * 86400.0
