"""The rollout controller: moves staged rollouts (``rollouts.py``) forward, from the database.

Each tick reads every running rollout and its executions and does what they say is next: assign
the version to the queued devices of the waves reached (a new desired revision each; the
publisher sends the signed documents), follow what those devices report (their retained
reported state) into their executions, time out the ones that went quiet, and, once a wave is
done and has baked, judge its gates: pass -> the next wave (or SUCCEEDED after the last), fail ->
roll back (each assigned device's desired state set to the version it had, which it still holds),
inconclusive -> PAUSED for an operator. Every judgement is recorded with the numbers it used.

Nothing lives only in memory: a control plane killed mid-rollout resumes where the database
says on its next tick, and a broker restart loses nothing (desired documents are retained and
published again; reports are retained too). Each rollout is stepped on its own: one that fails
(a bug, a row no code expected) is logged and tried again next tick, and after
``MAX_FAILED_TICKS`` in a row PAUSED with the error as its reason; it never stops the others.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from model_distribution.fleet.devices import Device, DeviceStore
from model_distribution.protocol.device_messages import DeviceState, ReportedState, reported_state
from model_distribution.registry.store import Registry
from model_distribution.rollout.judge import judge
from model_distribution.rollout.spec import (
    Execution,
    Rollout,
    RolloutConflict,
    RolloutError,
    RolloutSpec,
    held_text,
    joiner_wave,
    wave_plan,
)
from model_distribution.rollout.states import ACTIVE_STATES, DONE, REPORTED
from model_distribution.rollout.states import ExecutionState as E
from model_distribution.rollout.states import RolloutState as R
from model_distribution.rollout.store import RolloutStore

log = logging.getLogger(__name__)
# (a device's final states are states.REPORTED; WAITING, for its window, is IN_PROGRESS: the device
# says so again every minute, its heartbeat, which counts as word only until its window should have
# opened: at most a day for HH:MM-HH:MM, at most DAYS_TO_OPEN for a cron window)
MAX_FAILED_TICKS = 10


def start_rollout(registry: Registry, devices: DeviceStore, rollouts: RolloutStore, spec: RolloutSpec) -> Rollout:
    """Check ``spec`` against what is published and enrolled, then create the rollout (RUNNING).
    RolloutError (nothing written) for an unknown version or group, or a device with no version
    to go back to."""
    manifest = registry.resolve(spec.model)
    members = devices.list(group=spec.group)
    if not members:
        raise RolloutError(f"no device in group {spec.group!r}")
    bare = [d.device_id for d in members if d.desired is None]
    if bare:
        raise RolloutError(f"{len(bare)} device(s) of {spec.group!r} have no assigned version to roll back to "
                           f"({', '.join(bare[:5])}{', ...' if len(bare) > 5 else ''}): assign one first "
                           f"(cascade fleet assign --group {spec.group} NAME@VERSION)")
    plan_id = f"{manifest.ref}:{spec.group}:{time.time_ns()}"
    plan = wave_plan(plan_id, [d.device_id for d in members], spec.waves)
    return rollouts.create(spec, {d.device_id: (plan[d.device_id], d.desired) for d in members})


class RolloutController:
    def __init__(self, root: Path | str, poll_s: float = 0.5):
        self.root, self.poll_s = Path(root), poll_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.failures: dict[str, int] = {}  # rollout -> ticks in a row it failed

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-controller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        registry, devices, rollouts = Registry(self.root), DeviceStore(self.root), RolloutStore(self.root)
        try:
            while not self._stop.wait(self.poll_s):
                try:
                    tick(registry, devices, rollouts, failures=self.failures)
                except Exception:  # reading the rollouts failed (the database locked, say): the next tick reads again
                    log.exception("a rollout tick failed (the next one starts from the database again)")
        finally:
            registry.close()
            devices.close()
            rollouts.close()


def tick(registry: Registry, devices: DeviceStore, rollouts: RolloutStore, now: float | None = None,
         failures: dict[str, int] | None = None) -> None:
    """One pass over every rollout under way, each on its own: one that fails is logged (and,
    after MAX_FAILED_TICKS in a row, PAUSED with the error) and never stops the others."""
    failures = {} if failures is None else failures
    for r in rollouts.list(ACTIVE_STATES):
        try:
            step(r, registry, devices, rollouts, now or time.time())
            failures.pop(r.rollout_id, None)
        except Exception as e:
            n = failures[r.rollout_id] = failures.get(r.rollout_id, 0) + 1
            if n == 1:
                log.exception("rollout %s: its step failed (tried again each tick)", r.rollout_id)
            if n >= MAX_FAILED_TICKS and r.state == R.RUNNING:
                try:
                    rollouts.update(rollouts.get(r.rollout_id), state=R.PAUSED,
                                    reason=f"paused: the controller failed {n} times in a row: {e!r}"[:500])
                    failures.pop(r.rollout_id, None)
                except Exception:
                    log.exception("rollout %s could not be paused", r.rollout_id)


def step(r: Rollout, registry: Registry, devices: DeviceStore, rollouts: RolloutStore, now: float) -> None:
    manifest = registry.resolve(r.ref)
    members = {d.device_id: d for d in devices.list(group=r.group)}
    execs = rollouts.executions(r.rollout_id)
    known = {e.device_id for e in execs}
    for device_id, d in members.items():  # joined the group since the rollout started (and no other rollout holds it)
        if device_id not in known and d.desired is not None:
            rollouts.add_execution(r.rollout_id, device_id, joiner_wave(r.rollout_id, device_id, r.spec.waves),
                                   d.desired)
    due = []
    for e in rollouts.executions(r.rollout_id):
        d = members.get(e.device_id) or devices.get(e.device_id)
        if d is None:
            continue
        claimed = e.state == E.IN_PROGRESS and e.desired_rev is None  # claimed by a tick that did not finish
        if (e.state == E.QUEUED and e.wave <= r.wave or claimed) and r.state == R.RUNNING:
            due.append(e)
        elif e.state == E.IN_PROGRESS:
            _follow(e, reported_state(d.reported), r, rollouts, now)
    if due:
        _assign(due, manifest, r, registry, devices, rollouts, now)
    if r.state != R.RUNNING or rollouts.get(r.rollout_id).state != R.RUNNING:  # an operator may have stopped it
        return
    if r.spec.prefetch:  # the next wave fetches and verifies now; only its activation waits for the gates
        # (one wave ahead, not all: every later wave at once competed with the wave being judged)
        later = [e.device_id for e in rollouts.executions(r.rollout_id) if e.state == E.QUEUED and e.wave == r.wave + 1
                 and e.device_id in members and members[e.device_id].prefetch != r.ref]
        if later:
            devices.prefetch(manifest, later, r.spec.jitter_s)
    execs = rollouts.executions(r.rollout_id)
    wave = [e for e in execs if e.wave == r.wave]
    if r.wave_done_at is None:
        if all(e.state in DONE for e in wave):
            rollouts.update(r, wave_done_at=now)  # the bake starts once the wave's devices are done
        return
    if now - r.wave_done_at >= r.spec.bake_s:
        outcome, numbers, reason = judge(r, execs, devices, rollouts, now)
        _decided(r, registry, devices, rollouts, outcome, numbers, now, reason)


def _assign(due: list[Execution], manifest, r: Rollout, registry: Registry, devices: DeviceStore,
            rollouts: RolloutStore, now: float) -> None:
    """Tell these devices the version: three transactions for a whole wave. The executions are
    claimed first (compare-and-set), so an abort or a rollback that changed one meanwhile
    stands; one that lands between the claim and the record of the revision finds the claim and
    sends the device back, and this sees it and does the same."""
    claimed = [e for e in due if e.state != E.QUEUED]  # claimed by a tick that did not finish
    claimed += rollouts.move_all([e for e in due if e.state == E.QUEUED], E.IN_PROGRESS, "assigning", now)
    if not claimed or rollouts.get(r.rollout_id).state != R.RUNNING:
        return  # stopped since this tick began: the claims are settled by whoever stopped it
    told = devices.assign(manifest, device_ids=[e.device_id for e in claimed], window=r.spec.window,
                          jitter_s=r.spec.jitter_s)
    revs = {d.device_id: d.desired_rev for d in told}
    moved = {e.device_id for e in rollouts.move_all(claimed, E.IN_PROGRESS, "assigned", now, desired_revs=revs)}
    for e in claimed:
        if e.device_id not in moved and e.previous and \
                rollouts.execution(e.rollout_id, e.device_id).state in (E.CANCELED, E.ROLLED_BACK):
            devices.assign(registry.resolve(e.previous), device_id=e.device_id)  # rolled back under our feet


def _follow(e: Execution, report: ReportedState | None, r: Rollout, rollouts: RolloutStore, now: float) -> None:
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


def _decided(r: Rollout, registry: Registry, devices: DeviceStore, rollouts: RolloutStore, outcome: str,
             numbers: dict, now: float, reason: str | None) -> None:
    rollouts.decide(r.rollout_id, r.wave, outcome, numbers)
    log.info("rollout %s wave %d: %s %s", r.rollout_id, r.wave + 1, outcome, reason or "")
    if outcome == "pass":
        if r.wave + 1 >= len(r.spec.waves):
            rollouts.update(r, state=R.SUCCEEDED, reason=None)
        else:
            rollouts.update(r, wave=r.wave + 1, wave_done_at=None, reason=None)
    elif outcome == "fail":
        roll_back(r, registry, devices, rollouts, reason)
    else:
        rollouts.update(r, state=R.PAUSED, reason=f"inconclusive: {reason}")


def roll_back(r: Rollout, registry: Registry, devices: DeviceStore, rollouts: RolloutStore, reason: str) -> Rollout:
    """Every device the rollout assigned goes back to the version it had (which it still holds:
    no download), unless its desired version was changed since by someone else (then it is left
    as it is: going back would undo that); the queued ones are canceled."""
    for e in rollouts.executions(r.rollout_id):
        for _ in range(5):  # a tick may change an execution meanwhile: read it again and redo
            if e.state == E.QUEUED:
                if rollouts.move(e, E.CANCELED, "rolled back before its wave"):
                    break
            elif e.previous and e.state != E.ROLLED_BACK and (e.state != E.CANCELED or e.desired_rev is not None):
                # told (an abort cancels a told one too, and it keeps the version), or being told (claimed)
                now_desired = (devices.get(e.device_id) or Device(e.device_id, "")).desired
                if now_desired in (r.ref, e.previous) or e.desired_rev is None:
                    devices.assign(registry.resolve(e.previous), device_id=e.device_id)
                    detail = f"back to {e.previous}"
                else:
                    detail = f"left at {now_desired} (assigned since; not sent back to {e.previous})"
                if rollouts.move(e, E.ROLLED_BACK, detail):
                    break
            else:
                break
            e = rollouts.execution(e.rollout_id, e.device_id)
    _stop_prefetch(r, devices)
    fresh = rollouts.get(r.rollout_id)
    if fresh.state == R.ROLLED_BACK:  # rolled back meanwhile by another caller
        return fresh
    return rollouts.update(fresh, state=R.ROLLED_BACK, reason=reason) or rollouts.get(r.rollout_id)


def _stop_prefetch(r: Rollout, devices: DeviceStore) -> None:
    """The devices told to fetch this version ahead are told no more (what they hold stays)."""
    ahead = [d.device_id for d in devices.list(group=r.group) if d.prefetch == r.ref]
    if ahead:
        devices.prefetch(None, ahead)


# -- the operator's commands ---------------------------------------------------------------------

def pause(rollouts: RolloutStore, rollout_id: str) -> Rollout:
    r = rollouts.get(rollout_id)
    if r.state != R.RUNNING:
        raise RolloutError(f"rollout {rollout_id} is {r.state}, not RUNNING")
    return _cas(rollouts, r, state=R.PAUSED, reason="paused by the operator")


def resume(rollouts: RolloutStore, rollout_id: str) -> Rollout:
    """PAUSED -> RUNNING. A rollout paused as inconclusive at the end of a wave goes on to the
    next one (the operator's judgement stands in for the gate's); one paused by hand goes on
    where it was."""
    r = rollouts.get(rollout_id)
    if r.state != R.PAUSED:
        raise RolloutError(f"rollout {rollout_id} is {r.state}, not PAUSED")
    if (r.reason or "").startswith("inconclusive") and r.wave_done_at is not None:
        rollouts.decide(r.rollout_id, r.wave, "pass", {"by": "operator", "after": r.reason})
        if r.wave + 1 >= len(r.spec.waves):
            return _cas(rollouts, r, state=R.SUCCEEDED, reason=None)
        return _cas(rollouts, r, state=R.RUNNING, reason=None, wave=r.wave + 1, wave_done_at=None)
    return _cas(rollouts, r, state=R.RUNNING, reason=None)


def abort(rollouts: RolloutStore, rollout_id: str, devices: DeviceStore | None = None) -> Rollout:
    """Stop where it is: the queued devices are canceled; the ones already assigned keep it (an
    execution still under way is CANCELED too, saying so: no one follows it any more)."""
    r = rollouts.get(rollout_id)
    if r.state not in ACTIVE_STATES:
        raise RolloutError(f"rollout {rollout_id} is {r.state}: nothing to abort")
    for e in rollouts.executions(rollout_id):
        for _ in range(5):  # a tick may change it meanwhile: read it again and redo
            if e.state == E.QUEUED:
                done = rollouts.move(e, E.CANCELED, "aborted")
            elif e.state == E.IN_PROGRESS:
                done = rollouts.move(e, E.CANCELED, f"aborted while {e.detail or 'in progress'}: it keeps {r.ref}")
            else:
                break
            if done:
                break
            e = rollouts.execution(e.rollout_id, e.device_id)
    if devices is not None:
        _stop_prefetch(r, devices)
    return _cas(rollouts, r, state=R.ABORTED, reason="aborted by the operator")


def rollback(registry: Registry, devices: DeviceStore, rollouts: RolloutStore, rollout_id: str) -> Rollout:
    """Send the rollout's devices back. Refused (RolloutConflict) while another rollout under way
    holds any of them: going back would undo that one's work on them."""
    r = rollouts.get(rollout_id)
    if r.state == R.ROLLED_BACK:
        raise RolloutError(f"rollout {rollout_id} is rolled back already")
    untold = (E.QUEUED, E.CANCELED, E.ROLLED_BACK)
    told = [e.device_id for e in rollouts.executions(rollout_id) if e.state not in untold]
    held = rollouts.held_by_others(told, rollout_id)
    if held:
        raise RolloutConflict(f"{len(held)} of its devices are in another rollout under way ({held_text(held)}): "
                              "abort or finish that one first")
    return roll_back(r, registry, devices, rollouts, "rolled back by the operator")


def _cas(rollouts: RolloutStore, r: Rollout, **changes) -> Rollout:
    done = rollouts.update(r, **changes)
    if done is None:
        raise RolloutError(f"rollout {r.rollout_id} changed meanwhile: try again")
    return done
