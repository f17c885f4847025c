"""Desired and reported state over a real Mosquitto: the control plane's publisher and twenty
simulated devices in this process (the real device-side client). Assigned a version, every
device gets the signed document with the right digest and reports it; a device offline during
the assignment converges when it connects; the broker restarted mid-assignment, all converge;
a forged document is refused."""

from __future__ import annotations

import os
import threading
import time

import paho.mqtt.client as mqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from model_distribution.control_plane.publisher import DesiredPublisher
from model_distribution.device.state_client import DeviceStateClient
from model_distribution.fleet.desired import desired_document
from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol.topics import topic
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from sync.mqtt_link import stop_loop
from tests.unit.sync.test_mqtt import MOSQUITTO, Mosquitto, wait_until
from tests.unit.test_registry import make_gguf

pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")
N = 20


class SimDevice:
    """A device: applies what it is told (here: records it) and reports ACTIVE with the digest."""

    def __init__(self, broker: str, name: str, public_key: bytes):
        self.name = name
        self.applied: list[dict] = []
        self.lock = threading.Lock()
        self.client = DeviceStateClient(broker, "default", name, public_key, self.apply)

    def apply(self, payload: dict) -> None:
        with self.lock:
            self.applied.append(payload)
        self.client.report({"model": f"{payload['model']}@{payload['version']}", "sha256": payload["sha256"],
                            "state": "ACTIVE", "rev": payload["rev"]})

    def last(self) -> dict | None:
        with self.lock:
            return self.applied[-1] if self.applied else None


@pytest.fixture
def plane(tmp_path):
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    root = tmp_path / "fleet"
    repo = Repository(root)
    repo.init()
    reg, store = Registry(root), DeviceStore(root)
    v1, _ = reg.push(make_gguf(tmp_path / "a.gguf", 1.0), "tiny", "1.0.0")
    v2, _ = reg.push(make_gguf(tmp_path / "b.gguf", 2.0), "tiny", "1.1.0")
    for i in range(N):
        store.add(f"k{i}", ["kiosks"])
    url = f"mqtt://127.0.0.1:{broker.port}"
    pub = DesiredPublisher(reg, store, repo.desired_key(), url, poll_s=0.1)
    pub.start()
    try:
        devices = [SimDevice(url, f"k{i}", repo.desired_public_key()) for i in range(N)]
        yield {"broker": broker, "url": url, "store": store, "v1": v1, "v2": v2, "devices": devices, "repo": repo}
        for d in devices:  # a DISCONNECT wakes each network loop: loop_stop alone waits out its 1 s select, 20 times
            stop_loop(d.client.link.client)
    finally:
        pub.stop()
        broker.stop()
        reg.close()
        store.close()


def converged(plane, manifest, devices=None) -> bool:
    return all((d.last() or {}).get("sha256") == manifest.sha256 for d in devices or plane["devices"])


def test_a_group_converges_and_the_control_plane_sees_what_each_reports(plane):
    online = plane["devices"][:-1]
    for d in online:
        d.client.start()
    wait_until(lambda: all(d.client.connected.is_set() for d in online), "devices connected")
    plane["store"].assign(plane["v1"], group="kiosks")
    wait_until(lambda: converged(plane, plane["v1"], online), "all online devices active on 1.0.0")
    late = plane["devices"][-1]  # offline during the assignment: the retained document reaches it
    late.client.start()
    wait_until(lambda: converged(plane, plane["v1"]), "the late device active on 1.0.0")
    wait_until(lambda: all((d.reported or {}).get("state") == "ACTIVE" and d.reported["sha256"] ==
                           plane["v1"].sha256 for d in plane["store"].list(group="kiosks")), "reported state stored")
    assert all(len(d.applied) == 1 for d in plane["devices"])  # each applied once: no replay


def test_the_broker_restarted_mid_assignment_all_converge_on_the_newest(plane):
    for d in plane["devices"]:
        d.client.start()
    wait_until(lambda: all(d.client.connected.is_set() for d in plane["devices"]), "devices connected")
    plane["store"].assign(plane["v1"], group="kiosks")
    plane["broker"].stop()
    plane["store"].assign(plane["v2"], group="kiosks")  # while the broker is down
    plane["broker"].start()
    wait_until(lambda: converged(plane, plane["v2"]), "all active on 1.1.0 after the restart", timeout_s=30)
    for d in plane["devices"]:
        revs = [p["rev"] for p in d.applied]
        assert revs == sorted(revs) and revs[-1] == 2  # never went back to an older assignment


def test_a_forged_or_misaddressed_document_is_refused(plane):
    d = plane["devices"][0]
    d.client.start()
    wait_until(d.client.connected.is_set, "device connected")
    store = plane["store"]
    (dev,) = store.assign(plane["v1"], device_id="k0")
    wait_until(lambda: converged(plane, plane["v1"], [d]), "k0 active")
    attacker = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="attacker", protocol=mqtt.MQTTv311)
    attacker.connect("127.0.0.1", plane["broker"].port)
    attacker.loop_start()
    dev.desired_rev += 5
    forged = desired_document(dev, plane["v2"], Ed25519PrivateKey.generate())
    attacker.publish(topic("default", "k0", "desired"), forged, qos=1, retain=True).wait_for_publish(5)
    (other,) = store.list(device_ids=["k1"])
    other.desired_rev = 99
    misaddressed = desired_document(other, plane["v2"], plane["repo"].desired_key())
    attacker.publish(topic("default", "k0", "desired"), misaddressed, qos=1, retain=True).wait_for_publish(5)
    wait_until(lambda: len(d.client.refused) == 2, "both refused")
    assert d.last()["sha256"] == plane["v1"].sha256 and len(d.applied) == 1
    stop_loop(attacker)


def test_an_apply_that_raises_keeps_the_devices_mqtt_loop_and_the_next_assignment_applies(plane):
    d = plane["devices"][0]
    real, failed = d.apply, []

    def apply(payload):  # the first assignment fails on paho's thread
        if not failed:
            failed.append(payload["rev"])
            raise RuntimeError("disk full")
        real(payload)

    d.client.on_desired = apply
    d.client.start()
    wait_until(d.client.connected.is_set, "device connected")
    plane["store"].assign(plane["v1"], device_id="k0")
    wait_until(lambda: failed, "the first assignment tried")
    assert d.client.handed is None and d.client.applied.rev == -1  # not counted as applied
    plane["store"].assign(plane["v2"], device_id="k0")  # the loop still runs: this one arrives and applies
    wait_until(lambda: converged(plane, plane["v2"], [d]), "k0 active on 1.1.0")
    assert d.client.link.client.is_connected()


def test_cascade_fleet_serve_sends_what_the_fleet_commands_assign(tmp_path):
    import json
    import subprocess

    from cascade_cli.spawn import cascade_command
    from tests.conftest import REPO, Server

    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    home = tmp_path / "home"
    root = home / "fleet"
    repo = Repository(root)
    repo.init()
    reg = Registry(root)
    m, _ = reg.push(make_gguf(tmp_path / "a.gguf"), "tiny", "1.0.0")
    reg.close()
    url = f"mqtt://127.0.0.1:{broker.port}"
    server = Server(home, ["fleet", "serve"], "--broker", url).wait_healthy(60)
    device = SimDevice(url, "kiosk-7", repo.desired_public_key())
    try:
        def fleet(*args):
            return subprocess.run(cascade_command("fleet", *args, log_level=None), cwd=REPO, capture_output=True,
                                  text=True, env={**os.environ, "CASCADE_HOME": str(home)}, timeout=60)

        assert fleet("devices", "add", "kiosk-7", "--group", "kiosks").returncode == 0
        device.client.start()
        assert fleet("assign", "--group", "kiosks", "tiny@1.0.0").returncode == 0
        wait_until(lambda: (device.last() or {}).get("sha256") == m.sha256, "the device got its desired state")
        wait_until(lambda: (json.loads(fleet("devices", "--json").stdout)[0]["reported"] or {}).get("state")
                   == "ACTIVE", "the control plane stored the reported state")
    finally:
        device.client.stop()
        server.stop()
        broker.stop()


def test_device_credentials_reach_only_the_devices_own_topics_on_a_real_broker(tmp_path):
    from model_distribution.control_plane.broker import control_plane_credentials
    from model_distribution.control_plane.mosquitto_files import broker_files

    root = tmp_path / "fleet"
    store = DeviceStore(root)
    secrets_ = {d: store.add(d, ["kiosks"]) for d in ("k1", "k2")}
    user, secret = control_plane_credentials(root / "keys")
    passwd, acl = broker_files(store, tmp_path / "broker-files", user, secret)
    store.close()
    broker = Mosquitto(tmp_path / "broker")
    broker.conf.write_text(broker.conf.read_text().replace("allow_anonymous true", "allow_anonymous false")
                           + f"password_file {passwd}\nacl_file {acl}\n")
    broker.start()
    got: list[tuple[str, bytes]] = []

    def client(name, password, on_message=None):
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"t-{name}", protocol=mqtt.MQTTv311)
        c.username_pw_set(name, password)
        if on_message:
            c.on_message = on_message
        assert c.connect("127.0.0.1", broker.port) == 0
        c.loop_start()
        return c

    try:
        plane = client(user, secret, lambda c, u, m: got.append((m.topic, m.payload)))
        plane.subscribe("cascade/v1/#", qos=1)
        time.sleep(0.3)
        k1 = client("k1", secrets_["k1"])
        for t, body in [(topic("default", "k1", "reported"), b"own"), (topic("default", "k2", "reported"), b"forged"),
                        (topic("default", "k2", "desired"), b"forged-desired"),
                        (topic("default", "k1", "desired"), b"self-desired")]:
            k1.publish(t, body, qos=1).wait_for_publish(5)
        wait_until(lambda: (topic("default", "k1", "reported"), b"own") in got, "k1's own report")
        time.sleep(0.5)
        assert [p for _, p in got] == [b"own"]  # nothing of another device's, and no desired state
        refused = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="t-bad", protocol=mqtt.MQTTv311)
        refused.username_pw_set("k1", "wrong")
        refused.connect("127.0.0.1", broker.port)
        refused.loop_start()
        time.sleep(0.5)
        assert not refused.is_connected()  # the broker answered "not authorized"
        for c in (refused, plane, k1):
            stop_loop(c)
    finally:
        broker.stop()
