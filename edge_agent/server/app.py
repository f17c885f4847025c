"""``build_app(config)``: the edge agent's FastAPI application.

The lifespan loads the model into ``parallel`` backend slots and unloads it at shutdown;
handlers read the service from ``app.state``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
from contextlib import asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from fastapi import FastAPI

from cascade.config import cascade_home
from cascade.errors import one_line
from cascade.web import build_openai_app
from edge_agent.backends import load_slots
from edge_agent.backends.base import Backend
from edge_agent.config import EdgeConfig
from edge_agent.server.drain import Drain
from edge_agent.server.embeddings import EdgeEmbeddings
from edge_agent.server.escalation import Escalator
from edge_agent.server.metrics import EdgeMetrics
from edge_agent.server.outbox import Outbox
from edge_agent.server.reload import ConfigSource, Reloader
from edge_agent.server.routes import ops, v1
from edge_agent.server.service import EdgeService
from edge_agent.server.telemetry import spool_forever
from edge_agent.upstream import Upstream
from model_distribution.artifacts.catalog import PACKAGED, Catalog, ModelInfo, ModelNotFound

if TYPE_CHECKING:
    from sync.mqtt import MQTTConfig

log = logging.getLogger(__name__)


def locate_model(config: EdgeConfig, catalog: Catalog) -> ModelInfo:
    """The configured model, checked before anything listens (``cascade edge run`` exits 2 on these):
    ModelNotFound for llama.cpp; for onnx OnnxModelError (not an export, or no onnxruntime-genai
    here) and MixedOnnxRuntime."""
    if config.model.backend == "onnx":
        return onnx_model_info(config.model.name, catalog)
    info = catalog.get(config.model.name)
    if info.format != "gguf":
        raise ModelNotFound(f"{config.model.name} is an ONNX export: serve it with --backend onnx")
    return info


def onnx_model_info(name: str, catalog: Catalog) -> ModelInfo:
    """An ONNX Runtime GenAI export: a directory, or one the catalogue lists by that name."""
    import importlib.util

    from edge_agent.hardware import check_onnxruntime_install
    from model_distribution.artifacts.onnx_model import OnnxModelError

    path = Path(name).expanduser()
    if path.exists():
        info = catalog.onnx_info(path.resolve())
    else:
        listed = [m for m in catalog.list() if m.format == "onnx" and name in (m.name, m.path.name)]
        info = listed[0] if listed else catalog.onnx_info(path)  # the latter says why not
    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise OnnxModelError("[model] backend onnx needs onnxruntime-genai, which is not installed here "
                             "(pip install 'cascade-serve[edge,onnx]', or [edge,onnx-cuda] with CUDA: never both)")
    check_onnxruntime_install()  # MixedOnnxRuntime: two onnxruntime builds share one folder
    return info


def load_backends(config: EdgeConfig, catalog: Catalog) -> tuple[ModelInfo, list[Backend]]:
    """Locate the configured model and load one backend per slot."""
    info = locate_model(config, catalog)
    path = catalog.ensure_ready(info) if info.format == "gguf" else info.path
    return info, load_slots(info.format, path, info.name, info.quantization, config.model)


def model_names(info: ModelInfo) -> set[str]:
    """Every name a client may use for the served model."""
    names = {info.name, info.path.name, info.path.stem, str(info.path)}
    for p in PACKAGED:
        if p.name == info.name:
            names.update(p.aliases)
    return names


def configured_names(config: EdgeConfig, catalog: Catalog) -> set[str]:
    """The configured model's names, for an agent serving a fleet version instead: apps keep using them."""
    try:
        return model_names(catalog.get(config.model.name))
    except ModelNotFound:  # not on this device: only the version's own names
        return set()


def device_name(config: EdgeConfig) -> str:
    """[cascade] device, else this host's name, as an MQTT topic segment."""
    return re.sub(r"[/+#\s]", "-", config.cascade.device or socket.gethostname()) or "device"


def telemetry_target(config: EdgeConfig) -> MQTTConfig | None:
    """Where telemetry goes: [mqtt] when its host is set, else the fleet's broker as the enrolled
    device (its own credentials: the broker lets it write only its own telemetry topic)."""
    from sync.mqtt import MQTTConfig

    m, f = config.mqtt, config.fleet
    if m.host:
        return MQTTConfig(host=m.host, port=m.port, fleet=m.fleet, device=device_name(config), client_id=m.client_id,
                          keepalive_s=m.keepalive_s, username=m.username, password=m.password, tls=m.tls,
                          ca_file=m.ca_file)
    if f.broker:
        from sync.mqtt_link import parse_broker_url

        host, port, tls = parse_broker_url(f.broker)
        return MQTTConfig(host=host, port=port, fleet=f.fleet, device=f.device_id, client_id=f.device_id,
                          keepalive_s=m.keepalive_s, username=f.device_id, password=f.secret, tls=tls,
                          ca_file=f.broker_ca)
    return None


def device_link(config: EdgeConfig):
    """In a fleet: the device's one MQTT connection (the broker binds it to the device's
    identity), which its desired state and, unless [mqtt] names another broker, its telemetry
    share. Started by the caller once both have joined it."""
    f = config.fleet
    if not f.broker:
        return None
    from sync.mqtt_link import LinkConfig, MQTTLink

    return MQTTLink(LinkConfig.from_url(f.broker, f.device_id, f.secret, ca_file=f.broker_ca,
                                        keepalive_s=config.mqtt.keepalive_s, reconnect_min_s=0.5,
                                        reconnect_max_s=30.0))


def start_telemetry(config: EdgeConfig, svc: EdgeService, outbox: Outbox, link=None):
    """With [mqtt] host (or [fleet] broker) set: spool a telemetry record every interval and publish
    the spool (on the device's ``link`` when it goes to the fleet's broker)."""
    target = telemetry_target(config)
    if target is None:
        return None, None
    from sync.mqtt import TelemetryPublisher

    publisher = TelemetryPublisher(outbox.queue, target, None if config.mqtt.host else link)
    publisher.start()
    spool = asyncio.create_task(spool_forever(svc, outbox, target.device, target.fleet,
                                              config.mqtt.telemetry_interval_s, publisher.notify), name="telemetry")
    return publisher, spool


async def load_service(config: EdgeConfig, catalog: Catalog):
    """(the service on its loaded backends, the fleet version it serves or None): in a fleet, the
    version switched to last, if there is one; else the configured model."""
    fleet_version = None
    if config.fleet.broker:
        from edge_agent.server.fleet import load_installed, version_names

        fleet_version = await asyncio.to_thread(load_installed, config)
    if fleet_version is not None:
        backends = fleet_version[1]
        names = version_names(fleet_version[0], backends) | configured_names(config, catalog)
    else:
        info, backends = await asyncio.to_thread(load_backends, config, catalog)
        names = model_names(info)
    svc = EdgeService(config, backends, names, EdgeMetrics())
    svc.metrics.observe_queue(svc.pool)
    return svc, fleet_version


def build_app(config: EdgeConfig, catalog: Catalog | None = None, source: ConfigSource | None = None) -> FastAPI:
    """``source``: where ``config`` was read from; with it, SIGHUP reloads it (edge_agent/server/reload.py)."""
    catalog = catalog or Catalog(cascade_home(), config.model.search_paths)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        try:
            svc, fleet_version = await load_service(config, catalog)
        except (ValueError, RuntimeError, OSError) as e:  # llama.cpp or ONNX Runtime could not load the file
            reason = one_line(e) or type(e).__name__
            app.state.startup_error = ModelNotFound(f"cannot load model {config.model.name!r}: {reason}")
            raise app.state.startup_error from None
        upstream = Upstream(config.upstream, config.cascade.device) if config.upstream.url else None
        outbox = Outbox(config.sync, upstream)
        outbox.start()
        app.state.service = svc
        app.state.escalator = Escalator(config.cascade, svc, upstream, outbox)
        app.state.embeddings = EdgeEmbeddings(config)  # opens its context at the first embedding request
        link = device_link(config)  # in a fleet: one connection, the device's identity
        publisher, spool = start_telemetry(config, svc, outbox, link)
        follower = None
        if config.fleet.broker:
            from edge_agent.server.fleet import FleetFollower

            if fleet_version is not None:
                from edge_agent.server.fleet import apply_calibration, fleet_state_dir

                apply_calibration(app.state.escalator, fleet_version[0], fleet_state_dir(config))
            follower = FleetFollower(config, svc, app.state.escalator, asyncio.get_running_loop(),
                                     fleet_version[0] if fleet_version is not None else None, link)
            follower.start()
        if link is not None:
            link.start()
        reloader = Reloader(source, config, app.state.escalator, outbox).install() if source else None
        try:
            yield
        finally:
            if reloader is not None:
                await reloader.close()
            if follower is not None:
                follower.stop()
            if spool is not None:
                spool.cancel()
                await asyncio.to_thread(publisher.stop)
            if link is not None:
                await asyncio.to_thread(link.stop)
            await outbox.close()
            if app.state.escalator.upstream is not None:  # the one a reload swapped in, if any
                await app.state.escalator.upstream.close()
            await asyncio.to_thread(app.state.embeddings.close)
            svc.close()

    from edge_agent.server.status_count import CountAnswers  # every /v1 answer counted once, by status

    app = build_openai_app("cascade edge agent", lifespan, config, "edge", ops, v1)
    app.state.drain = Drain()
    app.add_middleware(CountAnswers)
    return app
