"""The rollout controller: moves staged rollouts (``spec.py``, ``states.py``) forward, from the database.

Each tick reads every running rollout and its executions and does what they say is next: assign
the version to the queued devices of the waves reached (a new desired revision each; the
publisher sends the signed documents), follow what those devices report (their retained
reported state) into their executions, time out the ones that went quiet, and, once a wave is
done and has baked, judge its gates: pass -> the next wave (or SUCCEEDED after the last), fail ->
roll back (each assigned device's desired state set to the version it had, which it still holds),
inconclusive -> PAUSED for an operator. Every judgement is recorded with the numbers it used.

How an execution follows its device's reports is follow.py; what stops or resumes a rollout
(a failed gate's roll back, the operator's pause, resume, abort and rollback) is actions.py.

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

from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol.device_messages import reported_state
from model_distribution.registry.store import Registry
from model_distribution.rollout.actions import roll_back
from model_distribution.rollout.follow import follow
from model_distribution.rollout.judge import judge
from model_distribution.rollout.spec import (
    Execution,
    Rollout,
    RolloutError,
    RolloutSpec,
    joiner_wave,
    wave_plan,
)
from model_distribution.rollout.states import ACTIVE_STATES, DONE
from model_distribution.rollout.states import ExecutionState as E
from model_distribution.rollout.states import RolloutState as R
from model_distribution.rollout.store import RolloutStore

log = logging.getLogger(__name__)
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
            follow(e, reported_state(d.reported), r, rollouts, now)
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
