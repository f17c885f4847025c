"""The rollout operations that ``cascade fleet rollout ...`` runs on the local state and the
control plane's ``/v1/fleet/rollouts`` runs for ``--url``: the same checks, the same dicts, so
both print the same. Like fleet/operations.py, errors are RegistryError with the kinds the HTTP API
answers apart: ``NotFound`` (404: no such version, group or rollout), ``Conflict`` (409: the
group has a rollout under way, or the rollout's state does not allow the command); the rest of
RolloutError is bad input (400).
"""

from __future__ import annotations

from model_distribution.fleet.devices import DeviceStore
from model_distribution.fleet.operations import Conflict, NotFound
from model_distribution.registry.store import Registry
from model_distribution.rollout import actions, controller
from model_distribution.rollout.spec import Rollout, RolloutConflict, RolloutError, RolloutSpec
from model_distribution.rollout.store import RolloutStore

COMMANDS = ("pause", "resume", "abort", "rollback")


def start(registry: Registry, devices: DeviceStore, rollouts: RolloutStore, spec: RolloutSpec) -> Rollout:
    """Start ``spec`` (RUNNING); nothing is written when it is refused."""
    name, sep, version = spec.model.partition("@")
    if sep and name and version and registry.get(name, version) is None:
        raise NotFound(f"{spec.model} is not published (see cascade fleet models)")
    if not devices.list(group=spec.group):
        raise NotFound(f"no device in group {spec.group!r} (cascade fleet devices add DEVICE --group {spec.group})")
    try:
        return controller.start_rollout(registry, devices, rollouts, spec)
    except RolloutConflict as e:  # its group's rollout, or another one holding some of its devices
        raise Conflict(str(e)) from e


def status(rollouts: RolloutStore, rollout_id: str) -> dict:
    """The rollout's dict with its executions (by wave) and its decisions (oldest first)."""
    r = _get(rollouts, rollout_id)
    return {**r.to_dict(), "executions": [e.to_dict() for e in rollouts.executions(rollout_id)],
            "decisions": rollouts.decisions(rollout_id)}


def command(registry: Registry, devices: DeviceStore, rollouts: RolloutStore, rollout_id: str, action: str) -> dict:
    """pause, resume, abort or rollback: the rollout's dict after it."""
    if action not in COMMANDS:
        raise ValueError(f"{action!r} is not one of {COMMANDS}")
    _get(rollouts, rollout_id)
    try:
        if action == "rollback":
            r = actions.rollback(registry, devices, rollouts, rollout_id)
        elif action == "abort":  # the devices told to fetch it ahead are told no more
            r = actions.abort(rollouts, rollout_id, devices)
        elif action == "pause":
            r = actions.pause(rollouts, rollout_id)
        else:
            r = actions.resume(rollouts, rollout_id)
    except RolloutError as e:  # its state does not allow it
        raise Conflict(str(e)) from e
    return r.to_dict()


def device_rows(devices: DeviceStore, rollouts: RolloutStore, group: str | None = None) -> list[dict]:
    """``cascade fleet devices``' rows: each device's dict (with its serving summary) and
    ``rollout``, its latest rollout's execution ({"id", "model", "state"}, None when it had none)."""
    latest = rollouts.device_states()
    rows = []
    for d in devices.list(group=group, serving=True):
        found = latest.get(d.device_id)
        rows.append({**d.to_dict(), "rollout": None if found is None else dict(zip(("id", "model", "state"), found,
                                                                                    strict=True))})
    return rows


def _get(rollouts: RolloutStore, rollout_id: str) -> Rollout:
    try:
        return rollouts.get(rollout_id)
    except RolloutError as e:
        raise NotFound(str(e)) from e
