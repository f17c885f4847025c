"""``cascade fleet serve``: the control plane's HTTP side (the MQTT side comes with the device
client). It serves what devices fetch and verify themselves, so any static HTTP store or CDN
can mirror it: the artifacts by sha256 (``GET /v1/artifacts/{sha256}``, HTTP Range, ETag = the
digest) and the signed TUF metadata (``GET /v1/tuf/{file}``); and, behind the admin key, the
registry (``GET /v1/fleet/models``). Configuration: ``fleet.toml`` / ``CASCADE_FLEET_<SECTION>_<KEY>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse

from cascade import errors
from cascade.config import cascade_home, load_config
from cascade.web import build_openai_app
from cascade.web.requests import bearer_matches
from model_distribution.devices import DeviceStore
from model_distribution.registry import Registry
from model_distribution.signing import Repository, SigningError
from model_distribution.state_sync import DesiredPublisher

log = logging.getLogger(__name__)
_TUF_FILE = re.compile(r"(?:\d+\.(?:root|targets|snapshot)|timestamp)\.json")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8090
    admin_key: str = ""  # bearer key of the operator's endpoints ("" leaves them to loopback callers only)
    timestamp_refresh_s: float = 3600.0  # re-sign the TUF timestamp this often (it expires after a day)

    def __post_init__(self):
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")


@dataclass
class MQTTConfig:
    broker: str = ""  # mqtt://host:port: desired state goes out and reported state comes in here ("": none)
    username: str = ""
    password: str = ""


@dataclass
class StateConfig:
    path: str = ""  # the control plane's state ("": $CASCADE_HOME/fleet)


@dataclass
class FleetConfig:
    server: ServerConfig = field(default_factory=ServerConfig)
    state: StateConfig = field(default_factory=StateConfig)
    mqtt: MQTTConfig = field(default_factory=MQTTConfig)

    @classmethod
    def load(cls, path=None, overrides=None, environ=None) -> FleetConfig:
        return load_config(cls, "fleet", path, overrides, environ)

    @property
    def root(self) -> Path:
        return Path(self.state.path).expanduser() if self.state.path else cascade_home() / "fleet"


ops = APIRouter()
files = APIRouter(prefix="/v1")
admin = APIRouter(prefix="/v1/fleet")


@files.get("/artifacts/{sha256}")
async def artifact(request: Request, sha256: str):
    """An artifact by its digest: Range requests resume a download; the ETag is the digest."""
    if not re.fullmatch(r"[0-9a-f]{64}", sha256):
        raise errors.bad_request("an artifact is named by its sha256: 64 lowercase hex digits", "sha256")
    path = request.app.state.registry.artifact_path(sha256)
    if not path.is_file():
        raise errors.APIError(404, f"no artifact {sha256}", "invalid_request_error", "sha256", "artifact_not_found")
    return FileResponse(path, media_type="application/octet-stream",
                        headers={"ETag": f'"{sha256}"', "Cache-Control": "public, max-age=31536000, immutable"})


@files.get("/tuf/{name}")
async def tuf_metadata(request: Request, name: str):
    if not _TUF_FILE.fullmatch(name):
        raise errors.APIError(404, f"no metadata {name!r}", "invalid_request_error", None, "not_found")
    path = request.app.state.repository.metadata_dir / name
    if not path.is_file():
        raise errors.APIError(404, f"no metadata {name!r}", "invalid_request_error", None, "not_found")
    return FileResponse(path, media_type="application/json", headers={"Cache-Control": "no-cache"})


def _require_admin(request: Request) -> None:
    expected = request.app.state.config.server.admin_key
    if expected:
        if not bearer_matches(request, expected):
            raise errors.unauthorized()
    elif request.client is None or request.client.host not in ("127.0.0.1", "::1"):
        raise errors.APIError(403, "set [server] admin_key to use the admin endpoints from another host",
                              "permission_error", None, "admin_key_required")


@admin.get("/models")
async def models(request: Request):
    _require_admin(request)
    return {"object": "list", "data": [m.to_dict() for m in request.app.state.registry.models()]}


@ops.get("/healthz")
async def healthz(request: Request):
    return {"status": "ok", "role": "fleet", "models": len(request.app.state.registry.models())}


def build_app(config: FleetConfig):
    repository = Repository(config.root)
    if not repository.initialized:
        repository.init()
        log.warning("no signing keys under %s: made them (cascade fleet keys init)", repository.keys_dir)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        app.state.registry = Registry(config.root)
        app.state.repository = repository
        refresher = asyncio.create_task(_refresh_timestamp(repository, config.server.timestamp_refresh_s))
        publisher = None
        if config.mqtt.broker:
            publisher = DesiredPublisher(Registry(config.root), DeviceStore(config.root), repository.desired_key(),
                                         config.mqtt.broker, username=config.mqtt.username or None,
                                         password=config.mqtt.password or None)
            publisher.start()
            log.info("desired state goes to %s", config.mqtt.broker)
        try:
            yield
        finally:
            refresher.cancel()
            if publisher is not None:
                publisher.stop()
            app.state.registry.close()

    return build_openai_app("cascade fleet", lifespan, config, "fleet", ops, files, admin)


async def _refresh_timestamp(repository: Repository, every_s: float) -> None:
    while True:
        try:
            await asyncio.to_thread(repository.refresh_timestamp)
        except SigningError as e:
            log.error("cannot re-sign the TUF timestamp: %s", e)
        await asyncio.sleep(every_s)


def run(config: FleetConfig) -> None:
    import uvicorn

    uvicorn.run(build_app(config), host=config.server.host, port=config.server.port, log_level="warning")
