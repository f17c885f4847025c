"""The control plane's staged-rollout endpoints, behind the admin key as the other ``/v1/fleet``
endpoints (what ``cascade fleet rollout ... --url`` calls; the same operations as the local
commands, rollout/commands.py):

    POST /v1/fleet/rollouts                   start: the RolloutSpec fields as JSON; 201 + the rollout
    GET  /v1/fleet/rollouts                   every rollout, newest first
    GET  /v1/fleet/rollouts/{id}              the rollout, its executions and its decisions
    POST /v1/fleet/rollouts/{id}/pause        (and /resume, /abort, /rollback): 409 when its state does not allow it

400 for bad input (waves, gates, durations, bounds), 404 for an unknown version, group or
rollout, 409 when the group has a rollout under way. The stores are the app's (app.state).
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from cascade.web import openapi, parse_body, read_json
from model_distribution.control_plane.auth import refused, require_admin
from model_distribution.registry.store import RegistryError
from model_distribution.rollout import commands
from model_distribution.rollout.spec import RolloutSpec

_BODY_LIMIT = 64 << 10
_MEANINGS = {404: "No such published version, group or rollout.",
             409: "The group has a rollout under way, or the rollout's state does not allow this."}


def _errors(*statuses: int) -> dict:
    """The error responses, with what a 404 and a 409 mean here; 401/403 as every admin endpoint."""
    documented = openapi.errors(401, 403, *statuses)
    for s, meaning in _MEANINGS.items():
        if s in documented:
            documented[s] = {**documented[s], "description": meaning}
    return documented


router = APIRouter(prefix="/v1/fleet/rollouts")


class StartRequest(BaseModel):
    """A RolloutSpec (model_distribution/rollout/spec.py); fields left out take its defaults."""

    model_config = ConfigDict(extra="forbid", strict=True)  # no true for a count, no "5" for a number
    model: str  # name@version
    group: str
    waves: list[int] | str = [1, 10, 50, 100]  # cumulative percentages, the last 100
    bake_s: float | str = 0.0  # seconds, or "90s", "2m", "1h"
    gates: list[str] = []  # e.g. "escalation_rate<=+0.05", "ttft_p95<=1.2x"
    max_failure_rate: float = 0.0
    min_executed: int = 1
    min_requests: int = 0
    min_devices: int = 1  # a gate is a robust mean over each side's devices, judged once this many have a value
    step_timeout_s: float | str = 600.0
    window: str | None = None  # "HH:MM-HH:MM" device local time: activate only then
    jitter_s: float | str = 0.0
    prefetch: bool = True  # later waves download and verify ahead


@router.post("", status_code=201, openapi_extra=openapi.body(StartRequest),
             responses=_errors(400, 404, 409, 413))
async def start(request: Request):
    require_admin(request)
    req = parse_body(StartRequest, await read_json(request, _BODY_LIMIT))
    state = request.app.state
    try:
        spec = RolloutSpec(**req.model_dump(exclude_unset=True))
        r = commands.start(state.registry, state.devices, state.rollouts, spec)
    except RegistryError as e:
        raise refused(e) from e
    return JSONResponse(r.to_dict(), status_code=201)


@router.get("", responses=_errors())
async def list_rollouts(request: Request):
    require_admin(request)
    return {"object": "list", "data": [r.to_dict() for r in request.app.state.rollouts.list()]}


@router.get("/{rollout_id}", responses=_errors(404))
async def status(request: Request, rollout_id: str):
    require_admin(request)
    try:
        return commands.status(request.app.state.rollouts, rollout_id)
    except RegistryError as e:
        raise refused(e) from e


def _command(request: Request, rollout_id: str, action: str) -> dict:
    require_admin(request)
    state = request.app.state
    try:
        return commands.command(state.registry, state.devices, state.rollouts, rollout_id, action)
    except RegistryError as e:
        raise refused(e) from e


_COMMAND_ERRORS = _errors(404, 409)


@router.post("/{rollout_id}/pause", responses=_COMMAND_ERRORS)
async def pause(request: Request, rollout_id: str):
    """RUNNING -> PAUSED: no new wave is told; the devices told go on."""
    return _command(request, rollout_id, "pause")


@router.post("/{rollout_id}/resume", responses=_COMMAND_ERRORS)
async def resume(request: Request, rollout_id: str):
    """PAUSED -> RUNNING (one paused as inconclusive goes on to its next wave)."""
    return _command(request, rollout_id, "resume")


@router.post("/{rollout_id}/abort", responses=_COMMAND_ERRORS)
async def abort(request: Request, rollout_id: str):
    """Stop where it is: the queued devices are canceled, the ones told keep the version."""
    return _command(request, rollout_id, "abort")


@router.post("/{rollout_id}/rollback", responses=_COMMAND_ERRORS)
async def rollback(request: Request, rollout_id: str):
    """Every device the rollout told goes back to the version it had; the queued are canceled."""
    return _command(request, rollout_id, "rollback")
