"""The operator's fleet endpoints, behind the admin key (what ``cascade fleet ... --url`` calls;
they run the operations the local commands run, fleet/operations.py):

    GET  /v1/fleet/models[?name=]   POST /v1/fleet/models?name=&version=  (the file is the body)
    GET  /v1/fleet/devices[?group=] POST /v1/fleet/devices   POST /v1/fleet/assign

(staged rollouts: rollout_routes.py).
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict
from starlette.requests import ClientDisconnect

from cascade import errors, wire
from cascade.web import parse_body, read_json
from cascade.web.openapi import body
from model_distribution.control_plane.auth import refused, require_admin
from model_distribution.fleet import operations
from model_distribution.registry.signing import SigningError
from model_distribution.registry.store import RegistryError, check_names
from model_distribution.rollout import commands as rollout_commands

BODY_LIMIT = 64 << 10


class EnrolRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    device: str
    groups: list[str] = []
    fleet: str = "default"


class AssignRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str  # name@version
    device: str | None = None
    group: str | None = None


admin = APIRouter(prefix="/v1/fleet")


@admin.get("/models")
async def models(request: Request, name: str | None = None):
    require_admin(request)
    return {"object": "list", "data": [m.to_dict() for m in request.app.state.registry.models(name)]}


@admin.post("/models")
async def push(request: Request, name: str = "", version: str = "", min_agent_version: str = ""):
    """Publish the request body (the model file, streamed to disk) as ``name@version``: 201 when
    new, 200 when these bytes are published under it already, 409 for other bytes, 400 with the
    reason for a bad file. ``X-Cascade-Calibration``: the ``[cascade]`` thresholds as JSON."""
    require_admin(request)
    state = request.app.state
    calibration = _calibration(request)
    try:  # refused before gigabytes arrive
        check_names(name, version, min_agent_version or None)
    except RegistryError as e:
        raise refused(e) from e
    uploads = state.config.root / "uploads"
    uploads.mkdir(parents=True, exist_ok=True)
    upload = uploads / f".push-{secrets.token_hex(8)}"
    try:
        await _receive(request, upload)
        async with state.push_lock:  # signing writes new metadata versions: one push at a time
            manifest, created = await asyncio.to_thread(operations.push, state.registry, state.repository, upload,
                                                        name, version, calibration, min_agent_version or None)
    except RegistryError as e:
        raise refused(e, upload) from e
    except SigningError as e:
        raise errors.APIError(500, f"cannot sign the target: {e}", "server_error") from e
    finally:
        upload.unlink(missing_ok=True)
    return JSONResponse({**manifest.to_dict(), "created": created}, status_code=201 if created else 200)


def _calibration(request: Request) -> dict | None:
    raw = request.headers.get("x-cascade-calibration")
    if raw is None:
        return None
    try:  # a header from outside: the one strict decoder (the registry then checks it as a device applies it)
        table = wire.loads(raw.encode("latin-1", "replace"), limit=BODY_LIMIT, max_depth=4)
    except wire.WireError as e:
        raise errors.bad_request(f"X-Cascade-Calibration is not JSON: {e}", "X-Cascade-Calibration") from e
    if not isinstance(table, dict):
        raise errors.bad_request("X-Cascade-Calibration must be a JSON object (the [cascade] thresholds)",
                                 "X-Cascade-Calibration")
    return table


async def _receive(request: Request, path: Path) -> None:
    """The request body into ``path`` as it arrives: a model is gigabytes, never all in memory."""
    try:
        with open(path, "wb") as f:
            async for chunk in request.stream():
                f.write(chunk)
    except ClientDisconnect as e:
        raise errors.bad_request("the upload was cut off") from e
    except OSError as e:  # the disk is full, say
        raise errors.APIError(507, f"cannot store the upload: {e}", "server_error", None, "insufficient_storage") from e


@admin.get("/devices")
async def devices(request: Request, group: str | None = None):
    require_admin(request)
    state = request.app.state
    return {"object": "list", "data": rollout_commands.device_rows(state.devices, state.rollouts, group)}


@admin.post("/devices", status_code=201, openapi_extra=body(EnrolRequest))
async def enrol(request: Request):
    """Enrol a device: its credentials, shown this once."""
    require_admin(request)
    req = parse_body(EnrolRequest, await read_json(request, BODY_LIMIT))
    try:
        return operations.enrol(request.app.state.devices, req.device, req.groups, req.fleet)
    except RegistryError as e:
        raise refused(e) from e


@admin.post("/assign", openapi_extra=body(AssignRequest))
async def assign(request: Request):
    """Set the desired version of one device or of every device of a group."""
    require_admin(request)
    req = parse_body(AssignRequest, await read_json(request, BODY_LIMIT))
    state = request.app.state
    try:
        manifest, changed = operations.assign(state.registry, state.devices, req.model, req.device, req.group)
    except RegistryError as e:
        raise refused(e) from e
    return {"model": manifest.ref, "sha256": manifest.sha256, "devices": [d.to_dict() for d in changed]}
