"""Issue 36's reproductions against real processes and real brokers: poison messages never stop the
control plane's listener nor break an operator's view (items 1, 2, 7), a signed document replayed
after a device restarts is refused (item 6), devices reach the fleet's broker over TLS (item 6),
the HTTP device endpoint refuses what MQTT refuses (items 2, 7), the small ones (item 17), and a
calibration pushed from another host travels whole (item 14)."""

from __future__ import annotations

import json
import os
import subprocess
import time

import paho.mqtt.client as mqtt
import pytest

from cascade.processes import free_port
from cascade_cli.spawn import cascade_command
from model_distribution.control_plane.broker import FleetBroker, TLSListener, control_plane_credentials, find_mosquitto
from model_distribution.control_plane.publisher import DesiredPublisher
from model_distribution.device.state_client import DeviceStateClient
from model_distribution.fleet.desired import AppliedDesired
from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol.topics import topic
from tests import loopback
from tests.conftest import REPO, Server
from tests.integration.test_fleet_broker import scratch_fleet
from tests.tls import make_ca_and_server
from tests.unit.sync.test_mqtt import wait_until
from tests.unit.test_registry import make_gguf

BROKERS = ["mosquitto", "embedded"]
POISON = [  # (topic kind, payload): what items 1-16 sent, and more of their kind
    ("telemetry", b'{"id":"t1","ts":1' + b"0" * 400 + b"}"),
    ("telemetry", b'{"id":"t2","ts":1e999}'),
    ("telemetry", b'{"id":"t3","ts":NaN,"requests":{"chat/200":Infinity}}'),
    ("telemetry", b'{"id":"t4","ts":1,"uptime_s":1,"requests":{"chat/500":1000000000}}'),
    ("telemetry", b"[" * 3000 + b"]" * 3000),
    ("reported", b'{"state":"ACTIVE","at":100000000000000000000}'),
    ("reported", b'{"state":NaN}'),
    ("reported", b'{"state":["ACTIVE"]}'),
    ("reported", b'{"state":"ACTIVE","reason":"one\\u2028two"}'),
    ("reported", b"\xff\xfe not utf-8"),
    ("reported", b'{"state":"ACTIVE","done":1' + b"0" * 30 + b"}"),
    ("events", b'{"event":"x\\u0085y"}'),
    ("events", b"[]"),
    ("status", b"hacked"),
]


def cli(home, *args, timeout=60):
    return subprocess.run(cascade_command("fleet", *args, log_level=None), cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "CASCADE_HOME": str(home)}, timeout=timeout)


def paho_client(port: int, user: str, password: str, tls_ca: str | None = None) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=user, clean_session=True, protocol=mqtt.MQTTv311)
    c.username_pw_set(user, password)
    if tls_ca:
        c.tls_set(ca_certs=tls_ca)
    c.connect("127.0.0.1", port)
    c.loop_start()
    return c


def strict_json(text: str):
    return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in an operator's view"))


@pytest.fixture(params=BROKERS)
def served(request, tmp_path):
    """`cascade fleet serve` with its own broker of each kind, two enrolled devices."""
    if request.param == "mosquitto" and find_mosquitto() is None:
        pytest.skip("needs mosquitto (apt-get install mosquitto)")
    home = tmp_path / "control"
    assert cli(home, "keys", "init").returncode == 0
    secrets = {d: strict_json(cli(home, "devices", "add", d, "--group", "g", "--json").stdout)["secret"]
               for d in ("honest", "hostile")}
    mqtt_port = free_port()

    def start():
        return Server(home, ["fleet", "serve"], "--mqtt-port", str(mqtt_port),
                      env={"CASCADE_FLEET_MQTT_PREFER": request.param}).wait_healthy(60)

    served = {"home": home, "secrets": secrets, "port": mqtt_port, "plane": start(), "start": start,
              "kind": request.param}
    yield served
    served["plane"].stop()  # the one running now: a test may have restarted it


def reported(plane, device: str) -> dict:
    r = loopback.get(f"{plane.url}/v1/fleet/devices", timeout=10)
    assert r.status_code == 200, r.text
    return next(d for d in strict_json(r.text)["data"] if d["device"] == device)["reported"] or {}


def test_no_poison_message_stops_the_listener_nor_breaks_a_view_even_across_a_restart(served):
    """Items 1, 2, 7: each message the issue's hostile device sent, and more; after each one the
    honest device's next report is still recorded; every view answers; after the control plane
    (and its broker) restart, nothing is redelivered to kill it and reports are recorded again."""
    s = served
    hostile = paho_client(s["port"], "hostile", s["secrets"]["hostile"])
    honest = paho_client(s["port"], "honest", s["secrets"]["honest"])
    for i, (kind, payload) in enumerate(POISON):
        hostile.publish(topic("default", "hostile", kind), payload, qos=1, retain=kind in ("reported", "status"))
        honest.publish(topic("default", "honest", "reported"), json.dumps({"state": "ACTIVE", "rev": i}).encode(),
                       qos=1, retain=True)
        wait_until(lambda i=i: reported(s["plane"], "honest").get("rev") == i, f"the honest report after {kind}", 20)
    health = loopback.get(f"{s['plane'].url}/healthz", timeout=10).json()
    assert health["status"] == "ok" and health["mqtt"] == {"connected": True, "publishing": True}
    metrics = loopback.get(f"{s['plane'].url}/metrics", timeout=10)
    assert metrics.status_code == 200
    refused = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.text.splitlines()
                  if line.startswith('cascade_fleet_device_messages_refused_total{kind='))
    assert refused >= len(POISON) - 1  # the one within bounds (t4's counts in 1 s of uptime) is refused too
    out = cli(s["home"], "devices", "--json")
    assert out.returncode == 0 and {d["device"] for d in strict_json(out.stdout)} == {"honest", "hostile"}
    assert cli(s["home"], "devices").returncode == 0
    honest.loop_stop()
    hostile.loop_stop()
    s["plane"].stop()
    s["plane"] = s["start"]()  # the broker gives back what it keeps (retained, queued): nothing stops it again
    honest = paho_client(s["port"], "honest", s["secrets"]["honest"])
    honest.publish(topic("default", "honest", "reported"), b'{"state":"ACTIVE","rev":99}', qos=1, retain=True)
    wait_until(lambda: reported(s["plane"], "honest").get("rev") == 99, "a report after the restart", 30)
    honest.loop_stop()


def test_the_http_device_endpoint_refuses_what_mqtt_refuses(served):
    """Items 2 and 7 over HTTP: the report that froze every rollout (an `at` past 64 bits) and
    the ones that broke the views are 400s with the reason, and counted."""
    s = served
    url = f"{s['plane'].url}/v1/devices/honest/reported"
    auth = ("honest", s["secrets"]["honest"])
    for body in (b'{"state":"ACTIVE","at":100000000000000000000}', b'{"state":NaN}', b'{"state":["ACTIVE"]}',
                 b'{"state":"ACTIVE","at":1e999}'):
        r = loopback.post(url, content=body, auth=auth, headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("the reported state is refused")
    assert loopback.post(url, json={"state": "ACTIVE", "rev": 3}, auth=auth).status_code == 204
    assert reported(s["plane"], "honest")["rev"] == 3
    assert "cascade_fleet_device_messages_refused_total" in loopback.get(f"{s['plane'].url}/metrics").text


@pytest.fixture(params=BROKERS)
def broker_fleet(request, tmp_path):
    """An in-process fleet: keys, a registry with a version, devices, the fleet's broker of each kind
    with a TLS listener too, and the control plane's publisher on it."""
    if request.param == "mosquitto" and find_mosquitto() is None:
        pytest.skip("needs mosquitto (apt-get install mosquitto)")
    root, repo, reg, store, v1, secrets = scratch_fleet(tmp_path, ("k0", "k1"))
    tls = make_ca_and_server(tmp_path / "tls")
    creds = control_plane_credentials(repo.keys_dir)
    broker = FleetBroker(root, port=0, credentials=creds, prefer=request.param,
                         tls=TLSListener("127.0.0.1", 0, tls["cert"], tls["key"]))
    url = broker.start()
    pub = DesiredPublisher(reg, store, repo.desired_key(), url, poll_s=0.1, username=creds[0], password=creds[1])
    pub.start()
    opened = []
    yield {"broker": broker, "url": url, "store": store, "reg": reg, "repo": repo, "v1": v1, "secrets": secrets,
           "tls": tls, "pub": pub, "opened": opened, "tmp": tmp_path}
    for c in opened:
        c.stop()
    pub.stop()
    broker.stop()
    reg.close()
    store.close()


def device(f, name: str, url: str | None = None, ca: str = "", applied_file=None):
    got: list[dict] = []
    client = DeviceStateClient(url or f["url"], "default", name, f["repo"].desired_public_key(), got.append,
                               password=f["secrets"][name], applied_file=applied_file, ca_file=ca)
    f["opened"].append(client)
    client.start()
    return client, got


def test_a_device_follows_its_desired_state_over_tls_and_a_broker_it_cannot_verify_is_refused(broker_fleet):
    f = broker_fleet
    client, got = device(f, "k0", f["broker"].tls_url, str(f["tls"]["ca"]))
    f["store"].assign(f["v1"], device_id="k0")
    wait_until(lambda: got and got[-1]["sha256"] == f["v1"].sha256, "k0's document over TLS")
    assert client.link.config.tls
    other_ca = make_ca_and_server(f["tmp"] / "other-ca")["ca"]
    stranger, got2 = device(f, "k1", f["broker"].tls_url, str(other_ca))  # a broker whose certificate it cannot trust
    f["store"].assign(f["v1"], device_id="k1")
    time.sleep(2)
    assert not stranger.connected.is_set() and not got2


def test_an_older_signed_document_replayed_after_a_device_restarts_is_refused(broker_fleet):
    """Item 6: capture revision N's bytes, assign N+1, restart the device, send N's bytes again."""
    f = broker_fleet
    applied = f["tmp"] / "device" / "desired.json"
    f["store"].assign(f["v1"], device_id="k0")
    first, got = device(f, "k0", applied_file=applied)
    wait_until(lambda: len(got) == 1, "the first document")
    old_doc = f["pub"].documents.get(f["store"].get("k0"), f["reg"])
    f["store"].assign(f["v1"], device_id="k0", window="02:00-05:00")  # a newer revision
    wait_until(lambda: len(got) == 2 and got[1]["rev"] == got[0]["rev"] + 1, "the newer document")
    first.stop()
    f["opened"].remove(first)
    f["pub"].stop()  # nobody publishes the current document again: the attacker's is the retained one
    attacker = paho_client(f["broker"].port, *control_plane_credentials(f["repo"].keys_dir))
    attacker.publish(topic("default", "k0", "desired"), old_doc, qos=1, retain=True).wait_for_publish(5)
    attacker.loop_stop()
    restarted, got_after = device(f, "k0", applied_file=applied)
    wait_until(lambda: restarted.refused, "the replay refused")
    assert "replay" in restarted.refused[-1] and [d["rev"] for d in got_after] in ([], [got[1]["rev"]]), got_after
    assert AppliedDesired(applied).rev == got[1]["rev"]


@pytest.fixture(scope="module")
def http_plane(tmp_path_factory):
    home = tmp_path_factory.mktemp("fleet-http")
    assert cli(home, "keys", "init").returncode == 0
    plane = Server(home, ["fleet", "serve"], env={"CASCADE_FLEET_MQTT_START": "false"}).wait_healthy(60)
    plane.home = home
    yield plane
    plane.stop()


def test_a_calibration_pushed_from_another_host_travels_whole_and_every_view_answers(http_plane, tmp_path):
    """Item 14: what `cascade calibrate` writes (the difficulty model by path, -inf for a threshold
    off) pushed with --url: the model goes inline, -inf as null, and `fleet models --url` answers."""
    (tmp_path / "difficulty.json").write_text(json.dumps({"weights": {"code": 0.9}, "bias": -1.5}))
    edge = tmp_path / "edge.toml"
    edge.write_text(f'[cascade]\nhold_tokens = 8\nmin_mean_logprob = -inf\ndifficulty_threshold = 0.6\n'
                    f'difficulty_model = "{tmp_path / "difficulty.json"}"\n')
    url = ("--url", http_plane.url)
    pushed = cli(tmp_path, "push", str(make_gguf(tmp_path / "a.gguf", 1.0)), "--name", "tiny", "--version", "1.0.0",
                 "--calibration", str(edge), "--json", *url)
    assert pushed.returncode == 0, pushed.stderr
    listed = cli(tmp_path, "models", "--json", *url)
    assert listed.returncode == 0, listed.stderr
    assert strict_json(listed.stdout)[0]["calibration"] == {
        "hold_tokens": 8, "min_mean_logprob": None, "difficulty_threshold": 0.6,
        "difficulty_model": {"weights": {"code": 0.9}, "bias": -1.5}}
    edge.write_text('[cascade]\nhold_tokens = 0\n')  # refused before the file goes over the network
    bad = cli(tmp_path, "push", str(tmp_path / "a.gguf"), "--name", "tiny", "--version", "1.0.1",
              "--calibration", str(edge), *url)
    assert bad.returncode == 2 and "hold_tokens" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1


def test_the_small_ones_head_long_versions_and_a_closed_pipe(http_plane, tmp_path):
    """Item 17: HEAD on an artifact; a version of 300 characters refused with one line; `| head`
    ends quietly."""
    home = http_plane.home
    pushed = cli(home, "push", str(make_gguf(tmp_path / "a.gguf", 2.0)), "--name", "small", "--version", "1.0.0",
                 "--json")
    sha = strict_json(pushed.stdout)["sha256"]
    secret = strict_json(cli(home, "devices", "add", "reader", "--json").stdout)["secret"]
    head = loopback.request("HEAD", f"{http_plane.url}/v1/artifacts/{sha}", auth=("reader", secret))
    assert head.status_code == 200 and int(head.headers["content-length"]) == strict_json(pushed.stdout)["size"]
    long = cli(home, "push", str(tmp_path / "a.gguf"), "--name", "small", "--version", "1.0.0-" + "a" * 300)
    assert long.returncode == 2 and "at most 64" in long.stderr and len(long.stderr.strip().splitlines()) == 1
    store = DeviceStore(home / "fleet")  # a table longer than a pipe holds (64 kB): the writer meets the closed end
    for i in range(1500):
        store.add(f"many-{i}", [])
    store.close()
    piped = subprocess.run(" ".join(cascade_command("fleet", "devices", log_level=None)) + " | head -1", shell=True,
                           cwd=REPO, capture_output=True, text=True, env={**os.environ, "CASCADE_HOME": str(home)})
    assert piped.stdout.startswith("DEVICE") and "Traceback" not in piped.stderr, piped.stderr


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


def test_a_flooding_device_neither_grows_the_broker_without_bound_nor_loses_anothers_state(served):
    """The attacker's flood: a device publishing 24 kB records as fast as its socket goes (QoS 0).
    The embedded broker paces each connection and drops a device's messages past its rate, so the
    honest device's report arrives at once; Mosquitto (no rate of its own) queues at most
    max_queued_bytes for the control plane (QoS 0 upgraded to the subscription's 1), and what it
    dropped meanwhile comes back from the retained copies when the flood stops."""
    import subprocess as sp

    s = served
    plane_pid = s["plane"].proc.pid
    broker_pid = plane_pid
    if s["kind"] == "mosquitto":
        broker_pid = int(sp.run(["pgrep", "-f", f"{s['home']}/fleet/broker/mosquitto.conf"], capture_output=True,
                                text=True).stdout.split()[0])
    before = _rss_mb(broker_pid)
    flooder = paho_client(s["port"], "hostile", s["secrets"]["hostile"])
    record = json.dumps({"id": "f", "ts": time.time(), "uptime_s": 1e6,
                         "requests": {f"a{i:0>60}": 1.0 for i in range(128)},
                         "decisions": {f"b{i:0>60}": 1.0 for i in range(128)},
                         "rejected": {f"c{i:0>60}": 1.0 for i in range(100)}}).encode()
    honest = paho_client(s["port"], "honest", s["secrets"]["honest"])
    start, sent, peak = time.monotonic(), 0, before
    while time.monotonic() - start < 6:
        for _ in range(200):
            flooder.publish(topic("default", "hostile", "telemetry"), record, qos=0)
            sent += 1
        if sent % 2000 == 0:
            peak = max(peak, _rss_mb(broker_pid))
        if sent == 2000:  # the honest device's state, mid-flood
            honest.publish(topic("default", "honest", "reported"), b'{"state":"ACTIVE","rev":77}', qos=1, retain=True)
    flooder.socket().close()  # what paho still holds for a paced connection would take minutes to write
    flooder.loop_stop()
    wait_until(lambda: reported(s["plane"], "honest").get("rev") == 77, "the honest state, the flood over", 30)
    assert peak - before < 700, f"the {s['kind']} broker grew {peak - before:.0f} MB"
    assert loopback.get(f"{s['plane'].url}/healthz", timeout=10).status_code == 200
    honest.loop_stop()
