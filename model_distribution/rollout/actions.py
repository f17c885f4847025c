"""What stops or resumes a rollout under way: a failed gate's roll back (the controller's), and
the operator's pause, resume, abort and rollback (what rollout/commands.py runs). Each move is a
compare-and-set through the store, so a tick that changed an execution meanwhile is read again."""

from __future__ import annotations

from model_distribution.fleet.devices import Device, DeviceStore
from model_distribution.registry.store import Registry
from model_distribution.rollout.spec import Rollout, RolloutConflict, RolloutError, held_text
from model_distribution.rollout.states import ACTIVE_STATES
from model_distribution.rollout.states import ExecutionState as E
from model_distribution.rollout.states import RolloutState as R
from model_distribution.rollout.store import RolloutStore


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
    for _ in range(5):  # a tick may write the row between the read and the move: read it again
        fresh = rollouts.get(r.rollout_id)
        if fresh.state == R.ROLLED_BACK:  # rolled back meanwhile by another caller
            return fresh
        done = rollouts.update(fresh, state=R.ROLLED_BACK, reason=reason)
        if done is not None:
            return done
    raise RolloutError(f"rollout {r.rollout_id} changed meanwhile: try again")


def _stop_prefetch(r: Rollout, devices: DeviceStore) -> None:
    """The devices told to fetch this version ahead are told no more (what they hold stays)."""
    ahead = [d.device_id for d in devices.list(group=r.group) if d.prefetch == r.ref]
    if ahead:
        devices.prefetch(None, ahead)


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
        if r.wave + 1 >= len(r.spec.waves):
            done = _cas(rollouts, r, state=R.SUCCEEDED, reason=None)
        else:
            done = _cas(rollouts, r, state=R.RUNNING, reason=None, wave=r.wave + 1, wave_done_at=None)
        # recorded once the move is made: a resume that lost the race judged nothing
        rollouts.decide(r.rollout_id, r.wave, "pass", {"by": "operator", "after": r.reason})
        return done
    return _cas(rollouts, r, state=R.RUNNING, reason=None)


def abort(rollouts: RolloutStore, rollout_id: str, devices: DeviceStore | None = None) -> Rollout:
    """Stop where it is: the queued devices are canceled; the ones already assigned keep it (an
    execution still under way is CANCELED too, saying so: no one follows it any more)."""
    r = rollouts.get(rollout_id)
    if r.state not in ACTIVE_STATES:
        if r.state == R.ABORTED:  # an abort cut short after its move (a crash): its executions are finished
            _cancel_executions(rollouts, r)
        raise RolloutError(f"rollout {rollout_id} is {r.state}: nothing to abort")
    # the rollout first: an abort that loses the race with a tick writes nothing (were the executions
    # canceled first, the rollout would stay RUNNING with a wave that never completes, holding its group);
    # once ABORTED, no tick touches its executions
    done = _cas(rollouts, r, state=R.ABORTED, reason="aborted by the operator")
    _cancel_executions(rollouts, r)
    if devices is not None:
        _stop_prefetch(r, devices)
    return done


def _cancel_executions(rollouts: RolloutStore, r: Rollout) -> None:
    """The queued executions and those under way are CANCELED (the ones under way keep the version)."""
    for e in rollouts.executions(r.rollout_id):
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
