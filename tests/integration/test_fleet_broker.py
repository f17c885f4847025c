"""The fleet's own broker (model_distribution/control_plane/broker.py), each test run against Mosquitto and
against the embedded amqtt one: the control plane's publisher and devices with their enrolled
secrets converge on an assigned version; a device reads and writes only its own topics; wrong,
unknown and anonymous logins are refused; a device enrolled after the start connects; retained
desired state reaches a device that connects later, also after the broker restarted."""

from __future__ import annotations

import threading
import time

import paho.mqtt.client as mqtt
import pytest

from model_distribution.control_plane.broker import FleetBroker, control_plane_credentials, find_mosquitto
from model_distribution.control_plane.publisher import DesiredPublisher
from model_distribution.device.state_client import DeviceStateClient
from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol.topics import topic
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from tests.unit.sync.test_mqtt import wait_until
from tests.unit.test_registry import make_gguf

DEVICES = ("k0", "k1", "k2")


class Client:
    """A plain paho client that records what it receives and how the broker answered its CONNECT."""

    def __init__(self, port: int, client_id: str, user: str | None, password: str | None, clean: bool = True,
                 will: str | None = None):
        self.got: list[tuple[str, bytes]] = []
        self.reasons: list = []
        self._lock = threading.Lock()
        self.c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=clean,
                             protocol=mqtt.MQTTv311)
        if user is not None:
            self.c.username_pw_set(user, password)
        if will is not None:
            self.c.will_set(will, b"offline", qos=1)
        self.c.on_connect = lambda c, u, flags, reason, props: self.reasons.append(reason)
        self.c.on_message = self._on_message
        self.c.connect("127.0.0.1", port)
        self.c.loop_start()
        wait_until(lambda: self.reasons, f"the broker's answer to {client_id}")

    def _on_message(self, client, userdata, message) -> None:
        with self._lock:
            self.got.append((message.topic, message.payload))

    @property
    def accepted(self) -> bool:
        return not self.reasons[0].is_failure

    def received(self) -> list[tuple[str, bytes]]:
        with self._lock:
            return list(self.got)

    def subscribe(self, *filters: str) -> None:
        done = threading.Event()
        self.c.on_subscribe = lambda *a: done.set()
        self.c.subscribe([(f, 1) for f in filters])
        assert done.wait(5), "no SUBACK"

    def publish(self, t: str, body: bytes, retain: bool = False) -> None:
        self.c.publish(t, body, qos=1, retain=retain).wait_for_publish(5)

    def drop(self) -> None:
        """Lose the connection without a DISCONNECT: the broker sends the last will."""
        self.c.loop_stop()
        self.c.socket().close()

    def close(self) -> None:
        self.c.disconnect()
        self.c.loop_stop()


class SimDevice:
    """A device with its enrolled secret: applies what it is told (records it) and reports ACTIVE."""

    def __init__(self, url: str, name: str, secret: str, public_key: bytes):
        self.applied: list[dict] = []
        self.lock = threading.Lock()
        self.client = DeviceStateClient(url, "default", name, public_key, self.apply, password=secret)

    def apply(self, payload: dict) -> None:
        with self.lock:
            self.applied.append(payload)
        self.client.report({"model": f"{payload['model']}@{payload['version']}", "sha256": payload["sha256"],
                            "state": "ACTIVE", "rev": payload["rev"]})

    def sha256(self) -> str | None:
        with self.lock:
            return self.applied[-1]["sha256"] if self.applied else None


def scratch_fleet(tmp_path, devices) -> tuple:
    """(root, repo, registry, store, version 1.0.0, secrets): keys made, one tiny version pushed,
    ``devices`` enrolled in group kiosks."""
    root = tmp_path / "fleet"
    repo = Repository(root)
    repo.init()
    reg, store = Registry(root), DeviceStore(root)
    v1, _ = reg.push(make_gguf(tmp_path / "a.gguf", 1.0), "tiny", "1.0.0")
    return root, repo, reg, store, v1, {d: store.add(d, ["kiosks"]) for d in devices}


@pytest.fixture(params=["mosquitto", "embedded"])
def fleet(request, tmp_path):
    if request.param == "mosquitto" and find_mosquitto() is None:
        pytest.skip("needs mosquitto (apt-get install mosquitto)")
    root, repo, reg, store, v1, secrets = scratch_fleet(tmp_path, DEVICES)
    user, secret = control_plane_credentials(repo.keys_dir)
    broker = FleetBroker(root, port=0, credentials=(user, secret), prefer=request.param)
    url = broker.start()
    assert broker.kind == request.param
    opened: list = []

    def client(name, password, client_id=None, clean=True, will=None):
        c = Client(broker.port, client_id or f"t-{name}-{len(opened)}", name, password, clean, will)
        opened.append(c)
        return c

    def publisher():
        pub = DesiredPublisher(reg, store, repo.desired_key(), url, poll_s=0.1, username=user, password=secret)
        opened.append(pub)
        pub.start()
        return pub

    def device(name):
        d = SimDevice(url, name, secrets[name], repo.desired_public_key())
        opened.append(d.client)
        return d

    yield {"broker": broker, "url": url, "store": store, "v1": v1, "secrets": secrets, "plane": (user, secret),
           "client": client, "publisher": publisher, "device": device}
    for c in opened:
        c.stop() if hasattr(c, "stop") else c.close()
    broker.stop()
    reg.close()
    store.close()


def test_devices_with_their_secrets_converge_on_the_assigned_version(fleet):
    fleet["publisher"]()
    devices = [fleet["device"](d) for d in DEVICES]
    for d in devices:
        d.client.start()
    wait_until(lambda: all(d.client.connected.is_set() for d in devices), "devices connected")
    fleet["store"].assign(fleet["v1"], group="kiosks")
    wait_until(lambda: all(d.sha256() == fleet["v1"].sha256 for d in devices), "every device active on 1.0.0")
    wait_until(lambda: all((d.reported or {}).get("state") == "ACTIVE" for d in fleet["store"].list()),
               "the control plane stored every device's reported state")


def test_a_device_cannot_write_another_devices_state_nor_any_desired_state(fleet):
    plane = fleet["client"](*fleet["plane"])
    plane.subscribe("cascade/v1/#")
    k1 = fleet["client"]("k1", fleet["secrets"]["k1"])
    for t, body in [(topic("default", "k2", "reported"), b"forged"), (topic("default", "k2", "desired"), b"forged"),
                    (topic("default", "k1", "desired"), b"self-desired"),
                    (topic("default", "k1", "reported"), b"own")]:
        k1.publish(t, body, retain=True)
    wait_until(lambda: (topic("default", "k1", "reported"), b"own") in plane.received(), "k1's own report")
    time.sleep(0.3)
    assert plane.received() == [(topic("default", "k1", "reported"), b"own")]
    plane.close()  # one identity, one connection: the next login of the control plane's user takes its session
    late = fleet["client"](*fleet["plane"])  # nothing forged was retained either
    late.subscribe("cascade/v1/#")
    wait_until(lambda: late.received(), "the retained report")
    time.sleep(0.3)
    assert late.received() == [(topic("default", "k1", "reported"), b"own")]


def test_a_device_receives_nothing_of_another_devices_topics(fleet):
    plane = fleet["client"](*fleet["plane"])
    plane.subscribe("cascade/v1/+/devices/+/reported")  # a filter that also covers other devices' topics
    for d in ("k1", "k2"):
        plane.publish(topic("default", d, "desired"), f"desired-{d}".encode(), retain=True)
    k2 = fleet["client"]("k2", fleet["secrets"]["k2"])
    k2.publish(topic("default", "k2", "reported"), b"reported-k2", retain=True)
    wait_until(lambda: (topic("default", "k2", "reported"), b"reported-k2") in plane.received(), "k2's report")
    k1 = fleet["client"]("k1", fleet["secrets"]["k1"], client_id="k1-persistent", clean=False)
    k1.c.subscribe([(topic("default", "k1", "desired"), 1), (topic("default", "k2", "desired"), 1),
                    ("cascade/v1/default/devices/+/desired", 1), ("cascade/v1/#", 1)])
    wait_until(lambda: k1.received(), "k1's own retained desired state")
    plane.publish(topic("default", "k2", "desired"), b"desired-k2-again", retain=True)
    plane.publish(topic("default", "k1", "desired"), b"desired-k1-again", retain=True)
    wait_until(lambda: (topic("default", "k1", "desired"), b"desired-k1-again") in k1.received(), "k1's new one")
    k1.close()  # a persistent session connecting again gets nothing of others either
    k1 = fleet["client"]("k1", fleet["secrets"]["k1"], client_id="k1-persistent", clean=False)
    time.sleep(0.5)
    assert {t for t, _ in k1.received()} <= {topic("default", "k1", "desired")}


def test_a_devices_last_will_reaches_only_its_own_status_topic(fleet):
    plane = fleet["client"](*fleet["plane"])
    plane.subscribe("cascade/v1/#")
    forger = fleet["client"]("k1", fleet["secrets"]["k1"], will=topic("default", "k2", "status"))
    if forger.accepted:  # the embedded broker refuses the forger's CONNECT; Mosquitto drops its will
        forger.drop()
    time.sleep(0.3)
    own = fleet["client"]("k1", fleet["secrets"]["k1"], will=topic("default", "k1", "status"))
    own.drop()
    wait_until(lambda: (topic("default", "k1", "status"), b"offline") in plane.received(), "k1's own last will")
    time.sleep(0.3)
    assert plane.received() == [(topic("default", "k1", "status"), b"offline")]


def test_a_wrong_secret_an_unknown_user_and_an_anonymous_client_are_refused(fleet):
    user, secret = fleet["plane"]
    for name, password in [("k1", "wrong"), ("k1", fleet["secrets"]["k2"]), ("nobody", "x"), (user, "wrong"),
                           (None, None), ("k1", None)]:
        c = fleet["client"](name, password)
        assert not c.accepted, (name, password)
        assert c.reasons[0] == "Not authorized"
    assert fleet["client"]("k1", fleet["secrets"]["k1"]).accepted
    assert fleet["client"](user, secret).accepted


def test_a_device_enrolled_after_the_start_connects(fleet):
    plane = fleet["client"](*fleet["plane"])
    plane.subscribe("cascade/v1/+/devices/+/reported")
    secret = fleet["store"].add("k9", ["kiosks"])
    fleet["broker"].refresh()  # Mosquitto rereads its files; the embedded broker asks the store anyway
    k9 = fleet["client"]("k9", secret)
    assert k9.accepted
    k9.publish(topic("default", "k9", "reported"), b"hello")
    wait_until(lambda: (topic("default", "k9", "reported"), b"hello") in plane.received(), "k9's report")


def test_retained_desired_state_reaches_a_device_that_connects_later_even_after_a_broker_restart(fleet):
    pub = fleet["publisher"]()
    store = fleet["store"]
    store.assign(fleet["v1"], device_id="k0")
    store.assign(fleet["v1"], device_id="k1")
    wait_until(lambda: pub._published.get("k0", (0,))[0] == 1 and pub._published.get("k1", (0,))[0] == 1,
               "both published")
    k0 = fleet["device"]("k0")
    k0.client.start()
    wait_until(lambda: k0.sha256() == fleet["v1"].sha256, "k0, connecting after the assignment, active")
    pub.stop()  # nobody publishes again from here on: k1 can get it only from the broker's retained store
    time.sleep(0.3)
    fleet["broker"].stop()
    fleet["broker"].start()
    k1 = fleet["device"]("k1")
    k1.client.start()
    wait_until(lambda: k1.sha256() == fleet["v1"].sha256, "k1, connecting after the restart, active")


def test_no_login_takes_the_control_planes_session_or_another_devices(fleet):
    """Issue 36, item 3: a device (or anyone) connecting with the control plane's client id, or
    with another device's, must not disconnect it: the broker binds a client id to its user."""
    pub = fleet["publisher"]()
    wait_until(lambda: pub.link.connected, "the control plane connected")
    k0 = fleet["device"]("k0")
    k0.client.start()
    wait_until(lambda: k0.client.connected.is_set(), "k0 connected")
    connects = (pub.link.connects, k0.client.link.connects)
    users = [("k1", fleet["secrets"]["k1"]), ("k1", "wrong"), ("nobody", "x"), (None, None)]
    for user, password in users:  # with its own credentials, wrong ones, none at all
        for client_id in ("cascade-control-plane", "k0"):
            c = fleet["client"](user, password, client_id=client_id, clean=False)
            time.sleep(0.2)
            if c.accepted:
                c.publish(topic("default", "k1", "reported"), b'{"state": "ACTIVE", "model": "tiny@1.0.0"}')
    fleet["store"].assign(fleet["v1"], device_id="k0")  # the control plane still publishes, k0 still follows
    wait_until(lambda: k0.sha256() == fleet["v1"].sha256, "k0 active on what the control plane published")
    wait_until(lambda: (fleet["store"].get("k0").reported or {}).get("state") == "ACTIVE", "k0's report recorded")
    wait_until(lambda: (fleet["store"].get("k1").reported or {}).get("model") == "tiny@1.0.0",
               "k1's report, sent under another client id, recorded as k1's")
    assert (pub.link.connects, k0.client.link.connects) == connects  # neither was disconnected
    assert pub.link.connected and k0.client.link.connected


def test_a_packet_past_the_brokers_bound_drops_only_its_sender(fleet):
    """A device's 1 MB message closes its own connection on both brokers (Mosquitto's
    max_packet_size; the embedded broker reads no packet past the same bound); others go on."""
    plane = fleet["client"](*fleet["plane"])
    plane.subscribe("cascade/v1/#")
    k1 = fleet["client"]("k1", fleet["secrets"]["k1"])
    gone = threading.Event()
    k1.c.on_disconnect = lambda *a: gone.set()
    k1.c.publish(topic("default", "k1", "telemetry"), b"x" * (1 << 20), qos=1)
    assert gone.wait(10), "the broker kept a connection that sent a 1 MB packet"
    k2 = fleet["client"]("k2", fleet["secrets"]["k2"])
    k2.publish(topic("default", "k2", "reported"), b"fine")
    wait_until(lambda: (topic("default", "k2", "reported"), b"fine") in plane.received(), "k2's report")
    assert all(len(body) < 1 << 20 for _, body in plane.received())


def test_a_reserved_name_is_never_a_device_nor_a_broker_user(fleet):
    """Issue 36, item 4: the control plane's broker user cannot be enrolled, and a store that holds
    one (enrolled before names were reserved) does not give it a broker login."""
    from model_distribution.fleet.device_secrets import _hash_secret, mosquitto_hash
    from model_distribution.registry.store import RegistryError

    user, secret = fleet["plane"]
    store = fleet["store"]
    for name in (user, "cascade-anything", "CASCADE-control-plane"):
        with pytest.raises(RegistryError, match="reserved"):
            store.add(name, ["kiosks"])
    store._db.execute("INSERT INTO devices (device_id, fleet, secret_hash, broker_hash, created_at) "
                      "VALUES (?, 'default', ?, ?, 0)", (user, _hash_secret("legacy"), mosquitto_hash("legacy")))
    fleet["broker"].refresh()
    assert not fleet["client"](user, "legacy").accepted  # the device's secret is no login
    plane = fleet["client"](user, secret)
    assert plane.accepted  # the control plane's own still is
    plane.subscribe("cascade/v1/#")
    k1 = fleet["client"]("k1", fleet["secrets"]["k1"])
    k1.publish(topic("default", "k1", "reported"), b"{}")
    wait_until(lambda: plane.received(), "the control plane still reads every device")


@pytest.mark.parametrize("prefer", ["mosquitto", "embedded"])
def test_fleet_serve_starts_its_own_broker_and_a_device_enrolled_later_follows_it(tmp_path, prefer):
    """`cascade fleet serve` with no --broker: it starts the fleet's broker (Mosquitto, or the
    embedded one on a machine without), publishes desired state there and records what devices
    report; a device enrolled while it runs logs in with its printed credentials."""
    import json
    import os
    import subprocess

    from cascade.processes import free_port
    from cascade_cli.spawn import cascade_command
    from tests.conftest import REPO, Server

    if prefer == "mosquitto" and find_mosquitto() is None:
        pytest.skip("needs mosquitto (apt-get install mosquitto)")
    home = tmp_path / "control"

    def fleet_cli(*args):
        out = subprocess.run(cascade_command("fleet", *args, log_level=None), cwd=REPO, capture_output=True,
                             text=True, env={**os.environ, "CASCADE_HOME": str(home)}, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    fleet_cli("keys", "init")
    mqtt_port = free_port()
    plane = Server(home, ["fleet", "serve"], "--mqtt-port", str(mqtt_port),
                   env={"CASCADE_FLEET_MQTT_PREFER": prefer}).wait_healthy(60)
    device = None
    try:
        assert f"MQTT broker ({prefer}) on mqtt://127.0.0.1:{mqtt_port}" in plane.log.read_text()
        fleet_cli("push", str(make_gguf(tmp_path / "a.gguf", 1.0)), "--name", "tiny", "--version", "1.0.0")
        secret = json.loads(fleet_cli("devices", "add", "late-1", "--json"))["secret"]
        fleet_cli("assign", "late-1", "tiny@1.0.0")
        repo = Repository(home / "fleet")
        device = SimDevice(f"mqtt://127.0.0.1:{mqtt_port}", "late-1", secret, repo.desired_public_key())
        device.client.start()  # Mosquitto learns of the new device within a couple of seconds: paho retries

        def reported():
            return json.loads(fleet_cli("devices", "--json"))[0]

        wait_until(lambda: (reported().get("reported") or {}).get("state") == "ACTIVE", "the device's report", 60)
        row = reported()
        assert row["online"] is True and row["reported"]["model"] == "tiny@1.0.0"
    finally:
        if device is not None:
            device.client.stop()
        plane.stop()
    wait_until(lambda: _refused(mqtt_port), "the broker to stop with the control plane", 20)


def _refused(port: int) -> bool:
    import socket

    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
        return False
    except OSError:
        return True


def test_sockets_that_never_log_in_are_bounded_and_closed(fleet, monkeypatch):
    """The attacker's idle sockets (no CONNECT, no credentials) held a file descriptor each until the
    control plane, which hosts the embedded broker, could not answer HTTP; Mosquitto is a process of
    its own with its own limits (it drops them after its keepalive-less timeout)."""
    import socket

    if fleet["broker"].kind != "embedded":
        pytest.skip("the embedded broker's bounds (Mosquitto runs apart from the control plane)")
    from model_distribution.control_plane import embedded_broker

    monkeypatch.setattr(embedded_broker, "CONNECT_TIMEOUT_S", 1.0)
    idle = [socket.create_connection(("127.0.0.1", fleet["broker"].port)) for _ in range(40)]
    time.sleep(0.5)

    def closed(s: socket.socket) -> bool:
        s.settimeout(0.05)
        try:
            return s.recv(1) == b""
        except (TimeoutError, BlockingIOError):
            return False
        except OSError:
            return True

    assert sum(closed(s) for s in idle) >= 40 - embedded_broker.MAX_PENDING_PER_ADDRESS  # past the bound: at once
    assert fleet["client"]("k1", fleet["secrets"]["k1"]).accepted  # a device still logs in meanwhile
    wait_until(lambda: all(closed(s) for s in idle), "every idle socket closed after the CONNECT timeout", 10)
    for s in idle:
        s.close()
