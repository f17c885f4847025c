"""Fifty devices with real downloads: `cascade fleet serve --broker` on a real Mosquitto, and fifty
simulated devices in this process, each running the real device side (DeviceStateClient follows
its desired topic, DeviceUpdater verifies the TUF target, downloads with Range resume into its
own state_dir and activates). Activation here checks the file's sha256 and records it where a
real agent would load the model. Assigned a version by group, every device reports ACTIVE with
the right digest, as the control plane stored it; a device offline during the assignment
converges once it connects; the broker restarted while downloads run, all converge on the
newest assignment with nothing half-activated."""

from __future__ import annotations

import dataclasses
import queue
import threading
from pathlib import Path

import numpy as np
import pytest

from model_distribution.device.client import DeviceConfig, DeviceUpdater
from model_distribution.device.state_client import DeviceStateClient
from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Manifest, Registry, file_sha256
from tests.conftest import Server
from tests.unit.sync.test_mqtt import MOSQUITTO, Mosquitto, wait_until
from tests.unit.test_registry import make_gguf

pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")
N = 50
SIZE = 2 << 20  # per artifact: enough that fifty downloads overlap the broker's restart


def sha256_of(path: Path) -> str:
    return file_sha256(path)[0]


class SimDevice:
    """One device: the real DeviceStateClient and DeviceUpdater, the updater on a thread of its
    own (as the agent's FleetFollower: paho's thread only hands the document over, and only the
    newest waiting one is applied)."""

    def __init__(self, name: str, secret: str, plane):
        self.name = name
        self.lock = threading.Lock()
        self.states: list[dict] = []  # every report, in order
        self.activated: list[str] = []  # the digest of each file activated, checked on disk
        self.downloading = plane.downloading
        self.client = DeviceStateClient(plane.broker_url, "default", name, plane.public_key, self._desired, name,
                                        secret)
        config = DeviceConfig(name, plane.http, plane.root_json, plane.tmp / "devices" / name, secret=secret)
        self.updater = DeviceUpdater(config, self._report, self._activate)
        self.state_dir = self.updater.config.state_dir
        self._wanted: queue.Queue = queue.Queue()
        self._worker = threading.Thread(target=self._work, name=f"updater-{name}", daemon=True)
        self._worker.start()

    def _desired(self, payload: dict) -> None:
        self._wanted.put(payload)

    def _work(self) -> None:
        while (payload := self._wanted.get()) is not None:
            while not self._wanted.empty():
                newer = self._wanted.get()
                if newer is None:
                    return
                payload = newer
            self.updater.apply(payload)

    def _report(self, state: dict) -> None:
        with self.lock:
            self.states.append(state)
        if state["state"] == "DOWNLOADING":
            self.downloading.set()
        self.client.report(state)

    def _activate(self, path: Path, manifest: dict) -> None:
        digest = sha256_of(path)
        if digest != manifest["sha256"] or path.stat().st_size != manifest["size"]:
            raise RuntimeError(f"{path} is not the signed artifact")
        with self.lock:
            self.activated.append(digest)

    def last_state(self) -> dict:
        with self.lock:
            return self.states[-1] if self.states else {}

    def active_on(self, m: Manifest) -> bool:
        s = self.last_state()
        return s.get("state") == "ACTIVE" and s.get("sha256") == m.sha256

    def stop(self) -> None:
        self._wanted.put(None)
        self._worker.join(timeout=30)
        self.client.stop()


@dataclasses.dataclass
class Plane:
    tmp: Path
    broker: Mosquitto
    broker_url: str
    server: Server
    http: str
    root_json: bytes
    public_key: bytes
    store: DeviceStore
    v1: Manifest
    v2: Manifest
    downloading: threading.Event
    devices: list[SimDevice] = dataclasses.field(default_factory=list)


def artifact(path: Path, seed: int) -> Path:
    """A small valid GGUF padded to SIZE with random bytes (each version a different artifact)."""
    make_gguf(path, float(seed))
    with open(path, "ab") as f:
        f.write(np.random.default_rng(seed).bytes(SIZE - path.stat().st_size))
    return path


def published(tmp_path: Path) -> tuple[Mosquitto, Path, Repository, list[Manifest]]:
    """A started Mosquitto and a fleet home with keys and tiny@1.0.0 and 1.1.0 published and signed."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    home = tmp_path / "control"
    repo = Repository(home / "fleet")
    repo.init()
    reg = Registry(home / "fleet")
    versions = []
    for i, version in enumerate(("1.0.0", "1.1.0")):
        m, _ = reg.push(artifact(tmp_path / f"v{i}.gguf", i + 1), "tiny", version)
        repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
        versions.append(m)
    reg.close()
    return broker, home, repo, versions


@pytest.fixture
def plane(tmp_path):
    broker, home, repo, versions = published(tmp_path)
    store = DeviceStore(home / "fleet")
    secrets_ = {f"k{i}": store.add(f"k{i}", ["kiosks"]) for i in range(N)}
    url = f"mqtt://127.0.0.1:{broker.port}"
    server = Server(home, ["fleet", "serve"], "--broker", url).wait_healthy(60)
    p = Plane(tmp_path, broker, url, server, server.url, repo.root_bytes(), repo.desired_public_key(), store,
              *versions, threading.Event())
    p.devices = [SimDevice(name, secret, p) for name, secret in secrets_.items()]
    yield p
    for d in p.devices:
        d.stop()
    server.stop()
    broker.stop()
    store.close()


def start(devices: list[SimDevice]) -> None:
    for d in devices:
        d.client.start()
    wait_until(lambda: all(d.client.connected.is_set() for d in devices), "devices connected", 30)


def stored_active(plane: Plane, m: Manifest) -> bool:
    """The control plane stored, for every device, ACTIVE on ``m`` for its newest assignment."""
    return all((d.reported or {}).get("state") == "ACTIVE" and d.reported.get("sha256") == m.sha256
               and d.reported.get("rev") == d.desired_rev for d in plane.store.list(group="kiosks"))


def check_disk(d: SimDevice, m: Manifest) -> None:
    """models/ holds the full verified file of ``m``, every file there is what its name says, and
    nothing is left in staging."""
    models = d.state_dir / "models"
    assert (models / m.sha256).stat().st_size == m.size, d.name
    for f in models.iterdir():
        assert sha256_of(f) == f.name, f"{d.name}: {f.name} is not the file its name says"
    staging = d.state_dir / "staging"
    assert not staging.exists() or not any(staging.iterdir()), f"{d.name}: left in staging: {list(staging.iterdir())}"


def test_a_group_downloads_and_activates_and_a_device_offline_meanwhile_catches_up(plane):
    online, late = plane.devices[:-1], plane.devices[-1]
    start(online)
    plane.store.assign(plane.v1, group="kiosks")
    wait_until(lambda: all(d.active_on(plane.v1) for d in online), "the online devices ACTIVE on 1.0.0", 60)
    assert not late.states  # offline: nothing reached it
    late.client.start()  # the retained desired document reaches it when it connects
    wait_until(lambda: late.active_on(plane.v1), "the late device ACTIVE on 1.0.0", 30)
    wait_until(lambda: stored_active(plane, plane.v1), "the control plane stored ACTIVE for every device", 30)
    for d in plane.devices:
        assert d.activated == [plane.v1.sha256], d.name  # one verified activation each, no replay
        order = [s["state"] for s in d.states]
        assert order[0] == "DOWNLOADING" and order[-3:] == ["VERIFYING", "ACTIVATING", "ACTIVE"], (d.name, order)
        check_disk(d, plane.v1)


def test_the_broker_restarted_while_downloads_run_all_converge_on_the_newest(plane):
    start(plane.devices)
    plane.store.assign(plane.v1, group="kiosks")
    assert plane.downloading.wait(30), "no device started downloading"
    plane.broker.stop()
    unfinished = [d.name for d in plane.devices if not d.active_on(plane.v1)]
    plane.store.assign(plane.v2, group="kiosks")  # while the broker is down
    plane.broker.start()
    wait_until(lambda: all(d.active_on(plane.v2) for d in plane.devices), "every device ACTIVE on 1.1.0", 60)
    wait_until(lambda: stored_active(plane, plane.v2), "the control plane stored ACTIVE on 1.1.0", 30)
    assert unfinished, "every device had finished before the broker went down: the restart came too late"
    for d in plane.devices:
        assert d.activated[-1] == plane.v2.sha256 and set(d.activated) <= {plane.v1.sha256, plane.v2.sha256}
        assert len(d.activated) == len(set(d.activated)), d.name  # never back to an older version
        assert not [s for s in d.states if s["state"] in ("FAILED", "REJECTED")], d.name
        check_disk(d, plane.v2)
