"""The control plane's device endpoints (HTTP Basic ``device_id:secret`` of an enrolled device,
or the admin key):

    GET  /v1/artifacts/{sha256}          an artifact, HTTP Range, ETag = the digest
    GET  /v1/tuf/{file}                  the signed TUF metadata
    GET  /v1/devices/{device}/desired    its signed desired document (the retained MQTT message)
    POST /v1/devices/{device}/reported   its reported state (as on MQTT)

Devices verify every artifact and metadata file themselves, so a mirror or CDN may serve the
first two from a copy; ``[server] public_downloads = true`` opens them here too (no credentials).
A device may read and write only its own ``/v1/devices/{device}/...``.
"""

from __future__ import annotations

import asyncio
import re

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from cascade import errors
from cascade.web.requests import read_body
from model_distribution.control_plane.auth import refused, require_device
from model_distribution.fleet import operations
from model_distribution.protocol.device_messages import MAX_REPORT_BYTES, RefusedMessage
from model_distribution.registry.store import RegistryError

_TUF_FILE = re.compile(r"(?:\d+\.(?:root|targets|snapshot)|timestamp)\.json")

files = APIRouter(prefix="/v1")
device_api = APIRouter(prefix="/v1/devices")


@files.api_route("/artifacts/{sha256}", methods=["GET", "HEAD"])
async def artifact(request: Request, sha256: str):
    """An artifact by its digest: Range requests resume a download; the ETag is the digest."""
    public = request.app.state.config.server.public_downloads
    if not public:
        await require_device(request)
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise errors.bad_request("an artifact is named by its sha256: 64 lowercase hex digits", "sha256")
    path = request.app.state.registry.artifact_path(sha256)
    if not path.is_file():
        raise errors.APIError(404, f"no artifact {sha256}", "invalid_request_error", "sha256", "artifact_not_found")
    cache = "public" if public else "private"  # a shared cache must not hand credentialed bytes to anyone
    return FileResponse(path, media_type="application/octet-stream",
                        headers={"ETag": f'"{sha256}"', "Cache-Control": f"{cache}, max-age=31536000, immutable"})


@files.api_route("/tuf/{name}", methods=["GET", "HEAD"])
async def tuf_metadata(request: Request, name: str):
    if not request.app.state.config.server.public_downloads:
        await require_device(request)
    if not _TUF_FILE.fullmatch(name):
        raise errors.APIError(404, f"no metadata {name!r}", "invalid_request_error", None, "not_found")
    path = request.app.state.repository.metadata_dir / name
    if not path.is_file():
        raise errors.APIError(404, f"no metadata {name!r}", "invalid_request_error", None, "not_found")
    return FileResponse(path, media_type="application/json", headers={"Cache-Control": "no-cache"})


# -- a device's own state ----------------------------------------------------------------------

@device_api.get("/{device}/desired")
async def desired(request: Request, device: str):
    """The device's signed desired document: the bytes the broker retains on its desired topic,
    for a device whose broker is down. It verifies it as it verifies the MQTT message."""
    await require_device(request, device)
    state = request.app.state
    found = state.devices.get(device)
    if found is None or found.desired is None:
        raise errors.APIError(404, f"no desired state for {device!r} (cascade fleet assign)", "invalid_request_error",
                              "device", "not_found")
    try:
        doc = state.documents.get(found, state.registry)
    except RegistryError as e:
        raise refused(operations.NotFound(str(e))) from e
    return Response(doc, media_type="application/json", headers={"Cache-Control": "no-store"})


@device_api.post("/{device}/reported", status_code=204)
async def reported(request: Request, device: str):
    """Record the device's reported state, as its retained reported message does over MQTT (the
    same codec, the same counters, the same rate: 429 past it)."""
    await require_device(request, device)
    body = await read_body(request, MAX_REPORT_BYTES)
    if request.app.state.devices.get(device) is None:
        raise errors.APIError(404, f"no device {device!r} enrolled", "invalid_request_error", "device", "not_found")
    try:
        await asyncio.to_thread(request.app.state.inbox.receive, device, "reported", body)
    except RefusedMessage as e:
        if e.reason == "rate":
            raise errors.APIError(429, str(e), "rate_limit_error", None, "too_many_reports",
                                  {"Retry-After": "5"}) from e
        code = "invalid_json" if e.reason in ("not_json", "non_finite", "int_range", "too_large") else \
            "invalid_encoding" if e.reason in ("encoding", "surrogate", "control_char") else "invalid_value"
        raise errors.bad_request(f"the reported state is refused ({e.reason}): {e}", None, code) from e
    return Response(status_code=204)
