"""``cascade fleet serve``: the control plane's HTTP side (the MQTT side is publisher.py), put
together from its routers:

    device endpoints   device_routes.py   (HTTP Basic device_id:secret, or the admin key)
    admin endpoints    admin_routes.py, rollout_routes.py  (bearer [server] admin_key; with none
                       set, loopback callers only; auth.py checks both)
    /metrics, /healthz here

Configuration (config.py): ``fleet.toml`` / ``CASCADE_FLEET_<SECTION>_<KEY>``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cascade import errors
from cascade.web import build_openai_app
from cascade.web.requests import bearer_matches
from model_distribution.control_plane.admin_routes import admin
from model_distribution.control_plane.config import FleetConfig
from model_distribution.control_plane.credentials import DeviceCredentials
from model_distribution.control_plane.device_routes import device_api, files
from model_distribution.control_plane.inbox import DeviceInbox
from model_distribution.control_plane.metrics import registry_for
from model_distribution.control_plane.publisher import DesiredPublisher
from model_distribution.control_plane.rollout_routes import router as rollouts
from model_distribution.fleet.desired import DesiredDocuments
from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository, SigningError
from model_distribution.registry.store import Registry
from model_distribution.rollout.controller import RolloutController
from model_distribution.rollout.store import RolloutStore

log = logging.getLogger(__name__)
ops = APIRouter()


@ops.get("/metrics")
async def metrics(request: Request):
    """Prometheus: rollouts, their devices and gate values, devices by state and version
    (metrics.py). Behind [server] metrics_key (bearer) when it is set."""
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
    from model_distribution.control_plane.broker import FleetBroker, TLSListener, control_plane_credentials

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
