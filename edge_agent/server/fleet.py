"""The agent in a fleet: with ``[fleet] broker`` set it follows its desired state. The device
client (model_distribution) verifies, downloads and reports; this module is the agent's side of
the switch: load the new version into fresh slots, smoke-test it, then swap atomically (requests
already holding or waiting for an old slot finish on the old model, new ones get the new one),
unload the old model once its slots are idle, and apply the thresholds calibrated for the new
version. Everything the switch needs (the loaded slots, a passed smoke test, the calibrated
thresholds and their difficulty model) is ready before it happens, and the switch itself cannot
fail, so anything that fails leaves the old model serving, thresholds and all."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import queue
import secrets
import threading
import time
from pathlib import Path

import cascade
from cascade import wire
from cascade.calibration import CalibrationError, CascadeConfig, check_calibration, thresholds
from cascade.config import cascade_home
from cascade.policy import PolicyConfig
from edge_agent.backends import load_slots
from edge_agent.backends.base import Backend, Finish, GenerationOptions
from edge_agent.config import EdgeConfig
from edge_agent.server.escalation import Escalator, policy_config
from edge_agent.server.service import EdgeService
from model_distribution.device.client import DeviceConfig, DeviceUpdater
from model_distribution.device.models_on_disk import installed, model_path
from model_distribution.device.state_client import DeviceStateClient

log = logging.getLogger(__name__)
SMOKE_PROMPT = "Hello"
SMOKE_TIMEOUT_S = 120.0
RETRY_MIN_S, RETRY_MAX_S = 5.0, 300.0  # pauses before a cut download is tried again
WAITING_HEARTBEAT_S = 60.0  # a version waiting for its window is looked at (and reported) this often


class FleetFollower:
    def __init__(self, config: EdgeConfig, svc: EdgeService, escalator: Escalator, loop: asyncio.AbstractEventLoop,
                 active: dict | None = None, link=None):
        """``active``: the installed version the agent started on (``load_installed`` checked its file);
        ``link``: the device's MQTT connection (sync/mqtt_link.py), shared with its telemetry and
        started by the caller; None: one of its own."""
        f = config.fleet
        self.config, self.svc, self.escalator, self.loop = config, svc, escalator, loop
        state_dir = fleet_state_dir(config)
        self.device = DeviceConfig(f.device_id, f.control_plane.rstrip("/"), Path(f.trust_root).read_bytes(),
                                   state_dir, cascade.__version__, f.disk_budget_bytes, secret=f.secret,
                                   artifact_url=f.artifact_url, metadata_url=f.metadata_url,
                                   memory_budget_bytes=f.memory_budget_bytes)
        self.client = DeviceStateClient(f.broker, f.fleet, f.device_id, bytes.fromhex(
            Path(f.desired_key).read_text().strip()), self._desired, f.device_id, f.secret or None, link=link,
            applied_file=state_dir / "desired.json", ca_file=f.broker_ca)  # the order of documents survives restarts
        self.updater = DeviceUpdater(self.device, self.client.report, self._activate, active)
        self._wanted: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="fleet-updater", daemon=True)

    def start(self) -> None:
        self._worker.start()
        self.client.start()

    def stop(self) -> None:
        self._wanted.put(None)
        self.client.stop()
        self._worker.join(timeout=5)  # a change under way finishes its step first
        self.updater.close()

    def _desired(self, payload: dict) -> None:  # paho's thread: hand over, never block it
        self._wanted.put(payload)

    def _work(self) -> None:
        """Apply the newest assignment. A download that was cut is tried again (resuming) after a
        growing pause; a version waiting for its activation window is applied again when the
        window opens (and every minute meanwhile: the control plane hears it is waiting); both
        until a newer assignment comes."""
        payload, pause = self._wanted.get(), RETRY_MIN_S
        while payload is not None:
            while not self._wanted.empty():  # only the newest assignment matters
                payload = self._wanted.get()
                if payload is None:
                    return
            try:
                self.updater.apply(payload)
            except Exception:
                log.exception("applying desired state %s failed", payload.get("version"))
            if self.updater.wait_s is not None:
                again = min(max(self.updater.wait_s, 1.0), WAITING_HEARTBEAT_S)
            elif self.updater.retry:
                log.warning("trying %s@%s again in %.0f s", payload.get("model"), payload.get("version"), pause)
                again, pause = pause, min(pause * 2, RETRY_MAX_S)
            else:
                payload, pause = self._wanted.get(), RETRY_MIN_S
                continue
            try:
                payload = self._wanted.get(timeout=again)  # a newer assignment (or stop) comes first
                pause = RETRY_MIN_S
            except queue.Empty:
                pass  # the same assignment again

    # -- the switch (on the updater's thread, then the event loop) ------------------------

    def _activate(self, path: Path, manifest: dict) -> None:
        backends = load_version(path, manifest, self.config)
        try:
            _smoke_test(backends[0])
            calibrated = prepare_calibration(self.escalator.config, manifest, self.device.state_dir)
            asyncio.run_coroutine_threadsafe(self._swap(backends, manifest, calibrated), self.loop).result(timeout=60)
        except BaseException:
            for b in backends:
                b.unload()
            raise

    async def _swap(self, backends: list[Backend], manifest: dict,
                    calibrated: tuple[CascadeConfig, PolicyConfig] | None) -> None:
        """The switch: nothing in it can fail (all it needs was made ready before)."""
        old = self.svc.swap(backends, self.svc.model_names | version_names(manifest, backends))
        if calibrated is not None:
            self.escalator.config, self.escalator.policy = calibrated
        log.info("now serving %s@%s (%s); thresholds %s", manifest["name"], manifest["version"],
                 manifest.get("sha256", "")[:12], manifest.get("calibration") or "unchanged")
        asyncio.get_running_loop().create_task(_unload_when_idle(old))


def fleet_state_dir(config: EdgeConfig) -> Path:
    f = config.fleet
    return Path(f.state_dir).expanduser() if f.state_dir else cascade_home() / "edge" / "fleet"


def load_installed(config: EdgeConfig) -> tuple[dict, list[Backend]] | None:
    """At start-up in a fleet: the version switched to last (``active.json``, its file checked), loaded
    into the slots; None when there is none (the configured model serves until one is assigned)."""
    manifest = installed(fleet_state_dir(config))
    if manifest is None:
        return None
    path = model_path(fleet_state_dir(config) / "models", manifest["sha256"], manifest.get("format"))
    log.info("serving the installed fleet version %s@%s (%s)", manifest["name"], manifest["version"], path)
    return manifest, load_version(path, manifest, config)


def load_version(path: Path, manifest: dict, config: EdgeConfig) -> list[Backend]:
    """One loaded backend per slot for a fleet version (all or none), on the backend its manifest's
    format names (gguf: llama.cpp, the file; onnx: ONNX Runtime GenAI, the unpacked directory),
    whatever ``[model] backend`` the agent started with."""
    return load_slots(manifest.get("format", "gguf"), path, manifest["name"], manifest.get("quantization", ""),
                      config.model)


def version_names(manifest: dict, backends: list[Backend]) -> set[str]:
    """The names a client may use for a fleet version: its name, name@version, the backend's name."""
    return {manifest["name"], f"{manifest['name']}@{manifest['version']}", backends[0].description.name}


def prepare_calibration(current: CascadeConfig, manifest: dict, state_dir: Path
                        ) -> tuple[CascadeConfig, PolicyConfig] | None:
    """The thresholds and policy the version's calibration makes of ``current`` (None: it has
    none), its difficulty model and router written to files of this device's (``state_dir/calibration``);
    CalibrationError (a ValueError) with the reason when it cannot be applied."""
    calibration = manifest.get("calibration") or {}
    if isinstance(calibration, str):  # the signed manifest carries it as a JSON string (TUF's canonical JSON)
        calibration = wire.loads(calibration, limit=1 << 20)
    if not calibration:
        return None
    checked = check_calibration(calibration)
    config = thresholds(checked, current)
    # the difficulty model and the router, each to a file of its own named after the version (the
    # agent judges the router against the model it serves); null: the version has none
    for key, suffix in (("difficulty_model", ".json"), ("router", ".router.json")):
        if key in checked:
            value, path = checked[key], ""
            if value is not None:
                path = str(_write_json(Path(state_dir) / "calibration" / f"{manifest.get('sha256', 'version')}{suffix}",
                                       value))
            config = dataclasses.replace(config, **{key: path})
    try:
        return config, policy_config(config)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CalibrationError(f"the calibration of {manifest.get('name')}@{manifest.get('version')} cannot be "
                               f"applied: {e}") from e


def apply_calibration(escalator: Escalator, manifest: dict, state_dir: Path) -> None:
    """At start-up: the installed version's calibration takes effect; one that cannot (a version
    installed before calibrations were checked) is logged and the configured thresholds stay."""
    try:
        calibrated = prepare_calibration(escalator.config, manifest, state_dir)
    except (CalibrationError, ValueError) as e:
        log.error("the installed version's calibration is not applied, the configured thresholds stay: %s", e)
        return
    if calibrated is not None:
        escalator.config, escalator.policy = calibrated


def _write_json(path: Path, value: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)
    return path


def _smoke_test(backend: Backend) -> None:
    """A fixed prompt must give text within a time bound, or the version is not switched to."""
    started = time.monotonic()
    got_text = False
    for ev in backend.generate(backend.tokenize(SMOKE_PROMPT), GenerationOptions(max_tokens=4, temperature=0.0),
                               threading.Event()):
        if isinstance(ev, Finish):
            break
        got_text = got_text or bool(ev.text)
        if time.monotonic() - started > SMOKE_TIMEOUT_S:
            raise RuntimeError(f"the smoke test took over {SMOKE_TIMEOUT_S:.0f} s")
    if not got_text:
        raise RuntimeError("the smoke test produced no text")


async def _unload_when_idle(pool) -> None:
    while pool.busy or pool.waiting:
        await asyncio.sleep(0.2)
    for b in pool.free_slots():
        await asyncio.to_thread(b.unload)
