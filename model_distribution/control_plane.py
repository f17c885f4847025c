"""``cascade fleet serve``: the control plane's HTTP side (the MQTT side is state_sync.py).

    device endpoints (HTTP Basic device_id:secret of an enrolled device, or the admin key)
      GET  /v1/artifacts/{sha256}          an artifact, HTTP Range, ETag = the digest
      GET  /v1/tuf/{file}                  the signed TUF metadata
      GET  /v1/devices/{device}/desired    its signed desired document (the retained MQTT message)
      POST /v1/devices/{device}/reported   its reported state (as on MQTT)
    admin endpoints (bearer [server] admin_key; with none set, loopback callers only)
      GET  /v1/fleet/models[?name=]   POST /v1/fleet/models?name=&version=  (the file is the body)
      GET  /v1/fleet/devices[?group=] POST /v1/fleet/devices   POST /v1/fleet/assign
      /v1/fleet/rollouts ...          staged rollouts (rollout_api.py)

Devices verify every artifact and metadata file themselves, so a mirror or CDN may serve the
first two from a copy; ``[server] public_downloads = true`` opens them here too (no credentials).
A device may read and write only its own ``/v1/devices/{device}/...``. The admin endpoints run
the operations the local ``cascade fleet`` commands run (operations.py). Configuration
(fleet_config.py): ``fleet.toml`` / ``CASCADE_FLEET_<SECTION>_<KEY>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import secrets
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict
from starlette.requests import ClientDisconnect

from cascade import errors, wire
from cascade.web import build_openai_app, parse_body, read_json
from cascade.web.openapi import body
from cascade.web.requests import bearer_matches, read_body
from model_distribution import operations, rollout_ops
from model_distribution.credentials import DeviceCredentials, basic_credentials
from model_distribution.desired import DesiredDocuments
from model_distribution.device_inbox import DeviceInbox
from model_distribution.device_messages import MAX_REPORT_BYTES, RefusedMessage
from model_distribution.devices import DeviceStore
from model_distribution.fleet_config import FleetConfig
from model_distribution.fleet_metrics import registry_for
from model_distribution.registry import Registry, RegistryError, check_names
from model_distribution.rollout_controller import RolloutController
from model_distribution.rollout_store import RolloutStore
from model_distribution.signing import Repository, SigningError
from model_distribution.state_sync import DesiredPublisher

log = logging.getLogger(__name__)
_TUF_FILE = re.compile(r"(?:\d+\.(?:root|targets|snapshot)|timestamp)\.json")
_BODY_LIMIT = 64 << 10


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


ops = APIRouter()
files = APIRouter(prefix="/v1")
device_api = APIRouter(prefix="/v1/devices")
admin = APIRouter(prefix="/v1/fleet")


# -- who is calling ----------------------------------------------------------------------------

def _require_admin(request: Request) -> None:
    expected = request.app.state.config.server.admin_key
    if expected:
        if not bearer_matches(request, expected):
            raise errors.unauthorized()
    elif request.client is None or request.client.host not in ("127.0.0.1", "::1"):
        raise errors.APIError(403, "set [server] admin_key to use the admin endpoints from another host",
                              "permission_error", None, "admin_key_required")


async def _require_device(request: Request, device_id: str | None = None) -> None:
    """The device endpoints: HTTP Basic ``device_id:secret`` of an enrolled device, which may use
    only its own ``/v1/devices/{device}/...``; or the admin key as a bearer token."""
    state = request.app.state
    admin_key = state.config.server.admin_key
    if admin_key and bearer_matches(request, admin_key):
        return
    pair = basic_credentials(request.headers.get("authorization", ""))
    client = request.client.host if request.client else "-"  # the TCP peer (a trusted proxy's X-Forwarded-For)
    ok = pair is not None and state.credentials.cached(*pair)
    if pair is not None and not ok:
        verdict = await asyncio.to_thread(state.credentials.check, pair[0], pair[1], client)
        if verdict is not True and verdict:
            raise errors.APIError(429, f"too many wrong credentials for {pair[0]!r} from this address: try again "
                                  f"in {verdict:.0f} s", "rate_limit_error", None, "too_many_failures",
                                  {"Retry-After": str(max(1, round(verdict)))})
        ok = verdict is True
    if not ok:
        raise errors.APIError(401, "a device endpoint: send the device's enrolled credentials as HTTP Basic "
                              "device_id:secret", "authentication_error", None, "invalid_credentials",
                              {"WWW-Authenticate": 'Basic realm="cascade fleet", charset="UTF-8"'})
    if device_id is not None and pair[0] != device_id:
        raise errors.APIError(403, f"device {pair[0]!r} may use only its own /v1/devices/{pair[0]}/...",
                              "permission_error", "device", "other_device")


def _refused(e: RegistryError, upload: Path | None = None) -> errors.APIError:
    """A refused operation as its HTTP error: 409 for what exists already, 404 for what does not, else 400."""
    message = str(e) if upload is None else str(e).replace(str(upload), "the uploaded file")
    if isinstance(e, (operations.ImmutableVersion, operations.Conflict)):
        return errors.APIError(409, message, "invalid_request_error", None, "conflict")
    if isinstance(e, operations.NotFound):
        return errors.APIError(404, message, "invalid_request_error", None, "not_found")
    return errors.bad_request(message, None, "invalid_value")


# -- what devices fetch (and a mirror copies) --------------------------------------------------

@files.api_route("/artifacts/{sha256}", methods=["GET", "HEAD"])
async def artifact(request: Request, sha256: str):
    """An artifact by its digest: Range requests resume a download; the ETag is the digest."""
    public = request.app.state.config.server.public_downloads
    if not public:
        await _require_device(request)
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
        await _require_device(request)
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
    await _require_device(request, device)
    state = request.app.state
    found = state.devices.get(device)
    if found is None or found.desired is None:
        raise errors.APIError(404, f"no desired state for {device!r} (cascade fleet assign)", "invalid_request_error",
                              "device", "not_found")
    try:
        doc = state.documents.get(found, state.registry)
    except RegistryError as e:
        raise _refused(operations.NotFound(str(e))) from e
    return Response(doc, media_type="application/json", headers={"Cache-Control": "no-store"})


@device_api.post("/{device}/reported", status_code=204)
async def reported(request: Request, device: str):
    """Record the device's reported state, as its retained reported message does over MQTT (the
    same codec, the same counters, the same rate: 429 past it)."""
    await _require_device(request, device)
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


# -- the operator's endpoints ------------------------------------------------------------------

@admin.get("/models")
async def models(request: Request, name: str | None = None):
    _require_admin(request)
    return {"object": "list", "data": [m.to_dict() for m in request.app.state.registry.models(name)]}


@admin.post("/models")
async def push(request: Request, name: str = "", version: str = "", min_agent_version: str = ""):
    """Publish the request body (the model file, streamed to disk) as ``name@version``: 201 when
    new, 200 when these bytes are published under it already, 409 for other bytes, 400 with the
    reason for a bad file. ``X-Cascade-Calibration``: the ``[cascade]`` thresholds as JSON."""
    _require_admin(request)
    state = request.app.state
    calibration = _calibration(request)
    try:  # refused before gigabytes arrive
        check_names(name, version, min_agent_version or None)
    except RegistryError as e:
        raise _refused(e) from e
    uploads = state.config.root / "uploads"
    uploads.mkdir(parents=True, exist_ok=True)
    upload = uploads / f".push-{secrets.token_hex(8)}"
    try:
        await _receive(request, upload)
        async with state.push_lock:  # signing writes new metadata versions: one push at a time
            manifest, created = await asyncio.to_thread(operations.push, state.registry, state.repository, upload,
                                                        name, version, calibration, min_agent_version or None)
    except RegistryError as e:
        raise _refused(e, upload) from e
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
        table = wire.loads(raw.encode("latin-1", "replace"), limit=_BODY_LIMIT, max_depth=4)
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
    _require_admin(request)
    state = request.app.state
    return {"object": "list", "data": rollout_ops.device_rows(state.devices, state.rollouts, group)}


@admin.post("/devices", status_code=201, openapi_extra=body(EnrolRequest))
async def enrol(request: Request):
    """Enrol a device: its credentials, shown this once."""
    _require_admin(request)
    req = parse_body(EnrolRequest, await read_json(request, _BODY_LIMIT))
    try:
        return operations.enrol(request.app.state.devices, req.device, req.groups, req.fleet)
    except RegistryError as e:
        raise _refused(e) from e


@admin.post("/assign", openapi_extra=body(AssignRequest))
async def assign(request: Request):
    """Set the desired version of one device or of every device of a group."""
    _require_admin(request)
    req = parse_body(AssignRequest, await read_json(request, _BODY_LIMIT))
    state = request.app.state
    try:
        manifest, changed = operations.assign(state.registry, state.devices, req.model, req.device, req.group)
    except RegistryError as e:
        raise _refused(e) from e
    return {"model": manifest.ref, "sha256": manifest.sha256, "devices": [d.to_dict() for d in changed]}


@ops.get("/metrics")
async def metrics(request: Request):
    """Prometheus: rollouts, their devices and gate values, devices by state and version
    (fleet_metrics.py). Behind [server] metrics_key (bearer) when it is set."""
    key = request.app.state.config.server.metrics_key
    if key and not bearer_matches(request, key):
        raise errors.unauthorized()
    body = await asyncio.to_thread(generate_latest, request.app.state.metrics)
    return Response(body, media_type=CONTENT_TYPE_LATEST)


@ops.get("/healthz")
async def healthz(request: Request):
    """ok, with the MQTT side's state; 503 when a loop of the control plane has stopped (the
    desired-state publisher or the rollout controller), which no device message can do."""
    state = request.app.state
    publisher = state.publisher
    mqtt = None if publisher is None else {"connected": publisher.link.connected, "publishing": publisher.alive}
    rollouts = state.controller.alive
    body = {"status": "ok", "role": "fleet", "models": len(state.registry.models()), "mqtt": mqtt,
            "rollout_controller": rollouts}
    if not rollouts or (publisher is not None and not publisher.alive):
        return JSONResponse({**body, "status": "failing"}, status_code=503)
    return body


def build_app(config: FleetConfig):
    repository = Repository(config.root)
    if not repository.initialized:
        repository.init()
        log.warning("no signing keys under %s: made them (cascade fleet keys init)", repository.keys_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.registry = Registry(config.root)
        app.state.repository = repository
        app.state.devices = DeviceStore(config.root)
        app.state.rollouts = RolloutStore(config.root)
        app.state.credentials = DeviceCredentials(DeviceStore(config.root), config.server.credential_cache_s)
        app.state.push_lock = asyncio.Lock()
        for stale in (config.root / "uploads").glob(".push-*"):  # pushes cut off by a restart
            stale.unlink(missing_ok=True)
        refresher = asyncio.create_task(_refresh_timestamp(repository, config.server.timestamp_refresh_s))
        metrics_store = RolloutStore(config.root)
        app.state.metrics = registry_for(app.state.devices, metrics_store)
        # what devices say, over MQTT and HTTP: one codec, one rate per device, one set of counters
        app.state.inbox = DeviceInbox(DeviceStore(config.root), app.state.metrics, config.server.device_rate,
                                      config.server.device_burst)
        publisher = None
        if config.mqtt.broker:
            publisher = DesiredPublisher(Registry(config.root), DeviceStore(config.root), repository.desired_key(),
                                         config.mqtt.broker, username=config.mqtt.username or None,
                                         password=config.mqtt.password or None, inbox=app.state.inbox,
                                         ca_file=config.mqtt.ca_file)
            publisher.start()
            log.info("desired state goes to %s", config.mqtt.broker)
        app.state.publisher = publisher
        # one signature per desired revision, shared with the publisher: HTTP and MQTT serve the same bytes
        app.state.documents = publisher.documents if publisher else DesiredDocuments(repository.desired_key())
        controller = RolloutController(config.root, config.server.rollout_tick_s)  # moves staged rollouts
        controller.start()
        app.state.controller = controller
        try:
            yield
        finally:
            refresher.cancel()
            controller.stop()
            metrics_store.close()
            if publisher is not None:
                publisher.stop()
            app.state.registry.close()
            app.state.devices.close()
            app.state.rollouts.close()
            app.state.credentials.store.close()
            app.state.inbox.store.close()

    from model_distribution.rollout_api import router as rollouts  # it imports this module's admin check

    return build_openai_app("cascade fleet", lifespan, config, "fleet", ops, files, device_api, admin, rollouts)


async def _refresh_timestamp(repository: Repository, every_s: float) -> None:
    while True:
        try:
            await asyncio.to_thread(repository.refresh_timestamp)
        except SigningError as e:
            log.error("cannot re-sign the TUF timestamp: %s", e)
        await asyncio.sleep(every_s)


def start_broker(config: FleetConfig):
    """The fleet's own broker (with [mqtt] broker unset and start on): devices log in with their
    enrolled credentials, the control plane with its own; [mqtt] then points at it."""
    from model_distribution.broker import FleetBroker, TLSListener, control_plane_credentials

    credentials = control_plane_credentials(config.root / "keys")
    m = config.mqtt
    tls = TLSListener(m.tls_host or m.listen_host, m.tls_port, m.certfile, m.keyfile) if m.tls_port else None
    broker = FleetBroker(config.root, m.listen_host, m.listen_port, credentials, m.prefer, tls=tls)
    m.broker = broker.start()
    m.username, m.password = credentials
    broker.follow_enrolments()
    print(f"cascade fleet: MQTT broker ({broker.kind}) on {m.broker}"
          + (f" and {broker.tls_url} (TLS)" if tls else ""), flush=True)
    return broker


def run(config: FleetConfig) -> None:
    """Serve until stopped; with no [mqtt] broker given, the fleet's own broker runs beside (and
    stops with) the control plane. RuntimeError when that broker cannot start."""
    import uvicorn

    broker = start_broker(config) if not config.mqtt.broker and config.mqtt.start else None
    try:
        # X-Forwarded-For is believed only from the proxies named (uvicorn trusts loopback's by default,
        # which let any local caller pick the address the credential throttle counts against)
        uvicorn.run(build_app(config), host=config.server.host, port=config.server.port, log_level="warning",
                    proxy_headers=bool(config.server.forwarded_allow_ips),
                    forwarded_allow_ips=config.server.forwarded_allow_ips or None)
    finally:
        if broker is not None:
            broker.stop()
