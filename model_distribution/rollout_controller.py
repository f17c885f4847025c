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
published again; reports are retained too).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from model_distribution.devices import DeviceStore
from model_distribution.registry import Registry
from model_distribution.rollouts import (
    ABORTED,
    ACTIVE_STATES,
    CANCELED,
    COMPLETED,
    DONE,
    FAILED,
    FAILURES,
    HALTED,
    IN_PROGRESS,
    PAUSED,
    QUEUED,
    REJECTED,
    ROLLED_BACK,
    RUNNING,
    SUCCEEDED,
    TIMED_OUT,
    Execution,
    Rollout,
    RolloutError,
    RolloutSpec,
    RolloutStore,
    joiner_wave,
    wave_plan,
    window_metrics,
)

log = logging.getLogger(__name__)
REPORTED = {"ACTIVE": SUCCEEDED, "FAILED": FAILED, "REJECTED": REJECTED}  # a device's final states
# (WAITING, for its window, is IN_PROGRESS: the device says so again every minute, its heartbeat)


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

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="rollout-controller", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        registry, devices, rollouts = Registry(self.root), DeviceStore(self.root), RolloutStore(self.root)
        try:
            while not self._stop.wait(self.poll_s):
                try:
                    tick(registry, devices, rollouts)
                except Exception:
                    log.exception("a rollout tick failed (the next one starts from the database again)")
        finally:
            registry.close()
            devices.close()
            rollouts.close()


def tick(registry: Registry, devices: DeviceStore, rollouts: RolloutStore, now: float | None = None) -> None:
    """One pass over every rollout under way."""
    for r in rollouts.list(ACTIVE_STATES):
        step(r, registry, devices, rollouts, now or time.time())


def step(r: Rollout, registry: Registry, devices: DeviceStore, rollouts: RolloutStore, now: float) -> None:
    manifest = registry.resolve(r.ref)
    members = {d.device_id: d for d in devices.list(group=r.group)}
    execs = rollouts.executions(r.rollout_id)
    known = {e.device_id for e in execs}
    for device_id, d in members.items():  # joined the group since the rollout started
        if device_id not in known and d.desired is not None:
            rollouts.add_execution(r.rollout_id, device_id, joiner_wave(r.rollout_id, device_id, r.spec.waves),
                                   d.desired)
    due = []
    for e in rollouts.executions(r.rollout_id):
        d = members.get(e.device_id) or devices.get(e.device_id)
        if d is None:
            continue
        claimed = e.state == IN_PROGRESS and e.desired_rev is None  # claimed by a tick that did not finish
        if (e.state == QUEUED and e.wave <= r.wave or claimed) and r.state == RUNNING:
            due.append(e)
        elif e.state == IN_PROGRESS:
            _follow(e, d.reported, r, rollouts, now)
    if due:
        _assign(due, manifest, r, registry, devices, rollouts, now)
    if r.state != RUNNING or rollouts.get(r.rollout_id).state != RUNNING:  # an operator may have stopped it
        return
    if r.spec.prefetch:  # the next wave fetches and verifies now; only its activation waits for the gates
        # (one wave ahead, not all: every later wave at once competed with the wave being judged)
        later = [e.device_id for e in rollouts.executions(r.rollout_id) if e.state == QUEUED and e.wave == r.wave + 1
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
        judge(r, execs, registry, devices, rollouts, now)


def _assign(due: list[Execution], manifest, r: Rollout, registry: Registry, devices: DeviceStore,
            rollouts: RolloutStore, now: float) -> None:
    """Tell these devices the version: three transactions for a whole wave. The executions are
    claimed first (compare-and-set), so an abort or a rollback that changed one meanwhile
    stands; one that lands between the claim and the record of the revision finds the claim and
    sends the device back, and this sees it and does the same."""
    claimed = [e for e in due if e.state != QUEUED]  # claimed by a tick that did not finish
    claimed += rollouts.move_all([e for e in due if e.state == QUEUED], IN_PROGRESS, "assigning", now)
    if not claimed or rollouts.get(r.rollout_id).state != RUNNING:
        return  # stopped since this tick began: the claims are settled by whoever stopped it
    told = devices.assign(manifest, device_ids=[e.device_id for e in claimed], window=r.spec.window,
                          jitter_s=r.spec.jitter_s)
    revs = {d.device_id: d.desired_rev for d in told}
    moved = {e.device_id for e in rollouts.move_all(claimed, IN_PROGRESS, "assigned", now, desired_revs=revs)}
    for e in claimed:
        if e.device_id not in moved and e.previous and \
                rollouts.execution(e.rollout_id, e.device_id).state in (CANCELED, ROLLED_BACK):
            devices.assign(registry.resolve(e.previous), device_id=e.device_id)  # rolled back under our feet


def _follow(e: Execution, reported: dict | None, r: Rollout, rollouts: RolloutStore, now: float) -> None:
    """An execution follows its device's report of this assignment (its revision or a later one);
    one that has said nothing new for the step timeout is TIMED_OUT (a heartbeat: each progress
    report counts as word). A FAILED the device will try again (``retry``: the network, a control
    plane restarting) is not final: the execution stays IN_PROGRESS until the step timeout."""
    rep = reported if isinstance(reported, dict) else {}
    rev, at = rep.get("rev"), rep.get("at")
    ours = rep.get("desired") == r.ref and isinstance(rev, int) and e.desired_rev is not None and rev >= e.desired_rev
    new = ours and isinstance(at, (int, float)) and not isinstance(at, bool) and at != e.report_at
    retrying = rep.get("state") == "FAILED" and rep.get("retry") is True  # a cut download: it tries again
    if ours and rep.get("state") in REPORTED and not retrying:
        reason = rep.get("reason") if isinstance(rep.get("reason"), str) else None
        rollouts.move(e, REPORTED[rep["state"]], reason and reason[:500], now, report_at=at if new else None)
    elif new and retrying:  # still under way, but only progress counts as word: the clock stays where it was
        rollouts.move(e, IN_PROGRESS, f"retrying: {rep.get('reason')}"[:500], max(e.updated_at, e.heard_at or 0),
                      report_at=at)
    elif new:
        detail = str(rep.get("state"))[:40]
        if rep.get("state") == "DOWNLOADING" and isinstance(rep.get("total"), int) and rep["total"] > 0 \
                and isinstance(rep.get("done"), int):
            detail = f"DOWNLOADING {100 * rep['done'] // rep['total']}%"
        rollouts.move(e, IN_PROGRESS, detail, now, report_at=at)
    elif now - max(e.updated_at, e.heard_at or 0) > r.spec.step_timeout_s:
        rollouts.move(e, TIMED_OUT, f"no word for {r.spec.step_timeout_s:.0f} s ({e.detail})", now)


def judge(r: Rollout, execs: list[Execution], registry: Registry, devices: DeviceStore, rollouts: RolloutStore,
          now: float) -> None:
    """The gates of wave ``r.wave``, which is done and has baked."""
    spec = r.spec
    reached = [e for e in execs if e.wave <= r.wave]
    executed = [e for e in reached if e.state in DONE]
    failures = [e for e in executed if e.state in FAILURES]
    numbers: dict = {"executed": len(executed), "failed": len(failures),
                     "failure_rate": len(failures) / len(executed) if executed else None,
                     "max_failure_rate": spec.max_failure_rate, "min_executed": spec.min_executed,
                     "reasons": sorted({e.detail for e in failures if e.detail})[:5]}
    if len(executed) >= spec.min_executed:
        if numbers["failure_rate"] > spec.max_failure_rate:
            return _decided(r, registry, devices, rollouts, "fail", numbers, now,
                            f"wave {r.wave + 1}: install failure rate {numbers['failure_rate']:.2f} above "
                            f"{spec.max_failure_rate}")
    elif failures:
        return _decided(r, registry, devices, rollouts, "inconclusive", numbers, now,
                        f"wave {r.wave + 1}: {len(failures)} of {len(executed)} executed failed, fewer than "
                        f"--min-executed {spec.min_executed} to judge")
    gates = spec.parsed_gates
    if gates:
        updated = [e.device_id for e in execs if e.state == SUCCEEDED]
        control = [e.device_id for e in execs if e.state == QUEUED]
        start = r.wave_done_at
        up = window_metrics({d: devices.telemetry_window(d, start, now) for d in updated}, start, now)
        ctl = window_metrics({d: devices.telemetry_window(d, start, now) for d in control}, start, now) \
            if control else None
        numbers.update(window=[start, now], updated=up, control=ctl, min_requests=spec.min_requests, gates=[])
        if up["requests"] < spec.min_requests or (ctl is not None and ctl["requests"] < spec.min_requests):
            return _decided(r, registry, devices, rollouts, "inconclusive", numbers, now,
                            f"wave {r.wave + 1}: too little traffic to judge ({up['requests']} requests on updated "
                            f"devices, {'-' if ctl is None else ctl['requests']} on the control group; "
                            f"--min-requests {spec.min_requests})")
        failed_gates, unknown = [], []
        for g in gates:
            ok, how = g.judge(up.get(g.metric), None if ctl is None else ctl.get(g.metric))
            numbers["gates"].append({"gate": g.text, "passed": ok, "how": how})
            if ok is False:
                failed_gates.append(how)
            elif up.get(g.metric) is None or (ctl is not None and ctl.get(g.metric) is None and g.kind != "absolute"):
                unknown.append(g.metric)  # traffic, but no value (say, agents too old to send it): not a pass
        if failed_gates:
            return _decided(r, registry, devices, rollouts, "fail", numbers, now,
                            f"wave {r.wave + 1}: gate failed: {'; '.join(failed_gates)}")
        if unknown:
            return _decided(r, registry, devices, rollouts, "inconclusive", numbers, now,
                            f"wave {r.wave + 1}: no value for {', '.join(unknown)} in the devices' telemetry")
    _decided(r, registry, devices, rollouts, "pass", numbers, now, None)


def _decided(r: Rollout, registry: Registry, devices: DeviceStore, rollouts: RolloutStore, outcome: str,
             numbers: dict, now: float, reason: str | None) -> None:
    rollouts.decide(r.rollout_id, r.wave, outcome, numbers)
    log.info("rollout %s wave %d: %s %s", r.rollout_id, r.wave + 1, outcome, reason or "")
    if outcome == "pass":
        if r.wave + 1 >= len(r.spec.waves):
            rollouts.update(r, state=COMPLETED, reason=None)
        else:
            rollouts.update(r, wave=r.wave + 1, wave_done_at=None, reason=None)
    elif outcome == "fail":
        roll_back(r, registry, devices, rollouts, reason)
    else:
        rollouts.update(r, state=PAUSED, reason=f"inconclusive: {reason}")


def roll_back(r: Rollout, registry: Registry, devices: DeviceStore, rollouts: RolloutStore, reason: str) -> Rollout:
    """Every device the rollout assigned goes back to the version it had (which it still holds:
    no download); the queued ones are canceled."""
    for e in rollouts.executions(r.rollout_id):
        for _ in range(5):  # a tick may change an execution meanwhile: read it again and redo
            if e.state == QUEUED:
                if rollouts.move(e, CANCELED, "rolled back before its wave"):
                    break
            elif e.state not in (CANCELED, ROLLED_BACK) and e.previous:  # told, or being told (claimed)
                devices.assign(registry.resolve(e.previous), device_id=e.device_id)
                if rollouts.move(e, ROLLED_BACK, f"back to {e.previous}"):
                    break
            else:
                break
            e = rollouts.execution(e.rollout_id, e.device_id)
    _stop_prefetch(r, devices)
    fresh = rollouts.get(r.rollout_id)
    return rollouts.update(fresh, state=HALTED, reason=reason) or rollouts.get(r.rollout_id)


def _stop_prefetch(r: Rollout, devices: DeviceStore) -> None:
    """The devices told to fetch this version ahead are told no more (what they hold stays)."""
    ahead = [d.device_id for d in devices.list(group=r.group) if d.prefetch == r.ref]
    if ahead:
        devices.prefetch(None, ahead)


# -- the operator's commands ---------------------------------------------------------------------

def pause(rollouts: RolloutStore, rollout_id: str) -> Rollout:
    r = rollouts.get(rollout_id)
    if r.state != RUNNING:
        raise RolloutError(f"rollout {rollout_id} is {r.state}, not RUNNING")
    return _cas(rollouts, r, state=PAUSED, reason="paused by the operator")


def resume(rollouts: RolloutStore, rollout_id: str) -> Rollout:
    """PAUSED -> RUNNING. A rollout paused as inconclusive at the end of a wave goes on to the
    next one (the operator's judgement stands in for the gate's); one paused by hand goes on
    where it was."""
    r = rollouts.get(rollout_id)
    if r.state != PAUSED:
        raise RolloutError(f"rollout {rollout_id} is {r.state}, not PAUSED")
    if (r.reason or "").startswith("inconclusive") and r.wave_done_at is not None:
        rollouts.decide(r.rollout_id, r.wave, "pass", {"by": "operator", "after": r.reason})
        if r.wave + 1 >= len(r.spec.waves):
            return _cas(rollouts, r, state=COMPLETED, reason=None)
        return _cas(rollouts, r, state=RUNNING, reason=None, wave=r.wave + 1, wave_done_at=None)
    return _cas(rollouts, r, state=RUNNING, reason=None)


def abort(rollouts: RolloutStore, rollout_id: str, devices: DeviceStore | None = None) -> Rollout:
    """Stop where it is: the queued devices are canceled; the ones already assigned keep it."""
    r = rollouts.get(rollout_id)
    if r.state not in ACTIVE_STATES:
        raise RolloutError(f"rollout {rollout_id} is {r.state}: nothing to abort")
    for e in rollouts.executions(rollout_id):
        while e.state == QUEUED and not rollouts.move(e, CANCELED, "aborted"):  # a tick claimed it meanwhile
            e = rollouts.execution(e.rollout_id, e.device_id)
    if devices is not None:
        _stop_prefetch(r, devices)
    return _cas(rollouts, r, state=ABORTED, reason="aborted by the operator")


def rollback(registry: Registry, devices: DeviceStore, rollouts: RolloutStore, rollout_id: str) -> Rollout:
    r = rollouts.get(rollout_id)
    if r.state == HALTED:
        raise RolloutError(f"rollout {rollout_id} is rolled back already")
    return roll_back(r, registry, devices, rollouts, "rolled back by the operator")


def _cas(rollouts: RolloutStore, r: Rollout, **changes) -> Rollout:
    done = rollouts.update(r, **changes)
    if done is None:
        raise RolloutError(f"rollout {r.rollout_id} changed meanwhile: try again")
    return done
