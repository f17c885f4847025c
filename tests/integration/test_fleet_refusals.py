"""What a real agent (llama.cpp) in a fleet refuses, each with the reason reported and its old
model still serving: a version needing a newer agent, one larger than its memory, an artifact
whose bytes are not the signed ones, targets metadata rolled back, targets signed by a key the
root does not trust, and a desired-state document the control plane did not sign."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time

import paho.mqtt.client as mqtt
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from cascade_cli.spawn import cascade_command
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from sync.mqtt_link import stop_loop
from tests import loopback
from tests.conftest import REPO, Agent, Server
from tests.unit.sync.test_mqtt import MOSQUITTO, Mosquitto, wait_until
from tests.unit.test_registry import make_gguf
from tests.unit.test_signing import roll_back_targets, sign_targets_with_an_untrusted_key

pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")
DEVICE = "kiosk-9"


def fleet(home, *args):
    out = subprocess.run(cascade_command("fleet", *args, log_level=None), cwd=REPO, capture_output=True, text=True,
                         env={**os.environ, "CASCADE_HOME": str(home)}, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_what_the_agent_refuses_is_reported_with_the_reason_and_the_old_model_keeps_serving(tmp_path):
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    home = tmp_path / "control"
    repo = Repository(home / "fleet")
    repo.init()
    reg = Registry(home / "fleet")
    versions = {}
    for i, (version, extra) in enumerate([("2.0.0", {"min_agent_version": "99.0.0"}), ("2.1.0", {}),
                                          ("2.2.0", {}), ("2.3.0", {}), ("2.4.0", {})]):
        m, _ = reg.push(make_gguf(tmp_path / f"{version}.gguf", float(i + 1)), "edge-model", version, **extra)
        repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
        versions[version] = m
    reg.close()
    url = f"mqtt://127.0.0.1:{broker.port}"
    plane = Server(home, ["fleet", "serve"], "--broker", url).wait_healthy(60)
    secret = json.loads(fleet(home, "devices", "add", DEVICE, "--json"))["secret"]
    (tmp_path / "device").mkdir()
    agent = Agent(tmp_path / "device", "--n-ctx", "512", "--threads", "1", "--parallel", "1", "--no-config", env={
        "CASCADE_EDGE_FLEET_BROKER": url, "CASCADE_EDGE_FLEET_DEVICE_ID": DEVICE, "CASCADE_EDGE_FLEET_SECRET": secret,
        "CASCADE_EDGE_FLEET_CONTROL_PLANE": plane.url,
        "CASCADE_EDGE_FLEET_TRUST_ROOT": str(repo.metadata_dir / "1.root.json"),
        "CASCADE_EDGE_FLEET_DESIRED_KEY": str(repo.desired_key_file)}).wait_healthy()
    seen: list[tuple[str, dict]] = []
    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-watcher")
    watcher.on_message = lambda c, u, m: seen.append((m.topic.rsplit("/", 1)[1], json.loads(m.payload)))
    watcher.connect("127.0.0.1", broker.port)
    watcher.subscribe([(f"cascade/v1/default/devices/{DEVICE}/reported", 1),
                       (f"cascade/v1/default/devices/{DEVICE}/events", 1)])
    watcher.loop_start()

    def outcome(ref: str) -> dict:
        def final():
            return next((s for kind, s in reversed(seen) if kind == "reported" and s.get("desired") == ref
                         and s.get("state") in ("ACTIVE", "FAILED", "REJECTED")), None)

        wait_until(lambda: final() is not None, f"the device's answer to {ref}", 60)
        return final()

    def still_serving_the_old_model():
        assert loopback.get(f"{agent.url}/v1/models").json()["data"][0]["id"] == "smollm2-135m"
        r = loopback.post(f"{agent.url}/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 3,
                                                           "cascade": {"mode": "local"}}, timeout=120)
        assert r.status_code == 200, r.text

    try:
        fleet(home, "assign", DEVICE, "edge-model@2.0.0")
        got = outcome("edge-model@2.0.0")
        assert got["state"] == "REJECTED" and "needs agent 99.0.0" in got["reason"], got
        still_serving_the_old_model()

        stored = home / "fleet" / "artifacts" / "sha256" / versions["2.1.0"].sha256
        data = bytearray(stored.read_bytes())
        data[-1] ^= 0xFF  # same length, other bytes
        stored.write_bytes(bytes(data))
        fleet(home, "assign", DEVICE, "edge-model@2.1.0")
        got = outcome("edge-model@2.1.0")
        assert got["state"] == "FAILED" and "does not match its signed target" in got["reason"], got
        still_serving_the_old_model()

        rolled_back_to = roll_back_targets(repo)  # older targets than the device has seen, validly signed
        fleet(home, "assign", DEVICE, "edge-model@2.2.0")
        got = outcome("edge-model@2.2.0")
        assert got["state"] == "REJECTED" and "signed metadata was refused" in got["reason"], got
        assert "version" in got["reason"], got  # refused as a rollback
        still_serving_the_old_model()

        sign_targets_with_an_untrusted_key(repo, rolled_back_to + 2)  # past any version the device has seen
        fleet(home, "assign", DEVICE, "edge-model@2.3.0")
        got = outcome("edge-model@2.3.0")
        assert got["state"] == "REJECTED" and "signed by 0/1 keys" in got["reason"], got
        still_serving_the_old_model()

        # a desired-state document signed by someone else, on the device's own topic
        body = json.dumps({"device": DEVICE, "fleet": "default", "rev": 999, "model": "edge-model",
                           "version": "2.4.0", "sha256": versions["2.4.0"].sha256, "size": versions["2.4.0"].size,
                           "format": "gguf"}).encode()
        forged = {"payload": base64.b64encode(body).decode(),
                  "signature": base64.b64encode(Ed25519PrivateKey.generate().sign(body)).decode()}
        watcher.publish(f"cascade/v1/default/devices/{DEVICE}/desired", json.dumps(forged), qos=1, retain=True)
        wait_until(lambda: any(k == "events" and e["event"] == "desired_refused" for k, e in seen), "the refusal", 30)
        time.sleep(1)
        assert not any(s.get("desired") == "edge-model@2.4.0" for k, s in seen if k == "reported")
        still_serving_the_old_model()
        wait_until(lambda: (json.loads(fleet(home, "devices", "--json"))[0].get("last_event") or {}).get(
            "event") == "desired_refused", "the control plane to record the refusal", 30)
    finally:
        stop_loop(watcher)
        agent.stop()
        plane.stop()
        broker.stop()


@pytest.fixture(scope="module")
def three_versions(tmp_path_factory):
    """`cascade fleet serve` (HTTP only) with tiny@1.0.0, 1.1.0 and 1.2.0 of about the same size."""
    home = tmp_path_factory.mktemp("fleet-home")
    repo = Repository(home / "fleet")
    repo.init()
    reg = Registry(home / "fleet")
    from model_distribution.fleet.devices import DeviceStore

    store = DeviceStore(home / "fleet")
    secret = store.add("kiosk-1", [])
    store.close()
    manifests = []
    for i, version in enumerate(("1.0.0", "1.1.0", "1.2.0")):
        src = make_gguf(home / f"{version}.gguf", float(i))
        with open(src, "ab") as f:
            f.write(bytes(range(256)) * 400)
        m, _ = reg.push(src, "tiny", version)
        repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
        manifests.append(m)
    reg.close()
    s = Server(home, ["fleet", "serve"], "--no-broker").wait_healthy(60)
    s.repo, s.manifests, s.secret = repo, manifests, secret
    yield s
    s.stop()


def _updater(plane, state_dir, **config):
    from model_distribution.device.client import DeviceConfig, DeviceUpdater

    states: list[dict] = []
    cfg = DeviceConfig("kiosk-1", plane.url, plane.repo.root_bytes(), state_dir, secret=plane.secret, **config)
    return DeviceUpdater(cfg, states.append, lambda path, manifest: None), states


def _desired(m, rev):
    return {"model": m.name, "version": m.version, "sha256": m.sha256, "size": m.size, "format": "gguf", "rev": rev}


def test_a_version_larger_than_the_memory_budget_is_rejected_up_front(three_versions, tmp_path):
    m = three_versions.manifests[0]
    up, states = _updater(three_versions, tmp_path / "d", memory_budget_bytes=m.size - 1)
    assert up.apply(_desired(m, 1)) == "REJECTED"
    assert "memory" in states[-1]["reason"] and not any(s["state"] == "DOWNLOADING" for s in states)


def test_older_versions_make_room_in_the_disk_budget_but_the_active_one_stays(three_versions, tmp_path):
    v1, v2, v3 = three_versions.manifests
    size = max(v1.size, v2.size, v3.size)
    models = tmp_path / "d" / "models"
    up, states = _updater(three_versions, tmp_path / "d", disk_budget_bytes=int(size * 2.5), keep_versions=3)
    assert up.apply(_desired(v1, 1)) == "ACTIVE" and up.apply(_desired(v2, 2)) == "ACTIVE"
    assert up.apply(_desired(v3, 3)) == "ACTIVE", states[-1]  # v1 dropped to fit: v2 (going back) and v3 kept
    assert sorted(p.name for p in models.iterdir()) == sorted([v2.sha256, v3.sha256])
    up2, states2 = _updater(three_versions, tmp_path / "e", disk_budget_bytes=int(size * 1.5))
    assert up2.apply(_desired(v1, 1)) == "ACTIVE"
    assert up2.apply(_desired(v2, 2)) == "REJECTED"  # only by dropping the version that serves
    assert "taken by the active version" in states2[-1]["reason"]
    assert [p.name for p in (tmp_path / "e" / "models").iterdir()] == [v1.sha256]


def test_a_control_plane_that_cannot_be_reached_is_a_failure_to_retry_not_a_refusal(three_versions, tmp_path):
    from cascade.processes import free_port
    from model_distribution.device.client import DeviceConfig, DeviceUpdater

    states: list[dict] = []
    cfg = DeviceConfig("kiosk-1", f"http://127.0.0.1:{free_port()}", three_versions.repo.root_bytes(), tmp_path / "d",
                       secret=three_versions.secret)
    up = DeviceUpdater(cfg, states.append, lambda path, manifest: None)
    assert up.apply(_desired(three_versions.manifests[0], 1)) == "FAILED" and up.retry
    assert "cannot fetch the signed metadata now" in states[-1]["reason"]
    up.close()


def test_outside_its_window_a_device_downloads_and_waits_and_it_fetches_ahead_what_it_is_told(three_versions,
                                                                                             tmp_path):
    import datetime

    from model_distribution.device.client import DeviceConfig, DeviceUpdater

    v1, v2, v3 = three_versions.manifests
    states: list[dict] = []
    activated: list[str] = []
    cfg = DeviceConfig("kiosk-1", three_versions.url, three_versions.repo.root_bytes(), tmp_path / "d",
                       secret=three_versions.secret)
    up = DeviceUpdater(cfg, states.append, lambda path, manifest: activated.append(manifest["version"]))
    assert up.apply(_desired(v1, 1)) == "ACTIVE"
    hour = datetime.datetime.now().hour
    closed = f"{(hour + 2) % 24:02d}:00-{(hour + 3) % 24:02d}:00"
    assert up.apply({**_desired(v2, 2), "window": closed}) == "WAITING"
    assert (tmp_path / "d" / "models" / v2.sha256).exists() and activated == ["1.0.0"]  # fetched, not switched
    assert states[-1]["state"] == "WAITING" and states[-1]["model"] == "tiny@1.0.0" and 0 < up.wait_s <= 3 * 3600
    opened = f"{hour:02d}:00-{(hour + 1) % 24:02d}:00"
    prefetch = {"model": v3.name, "version": v3.version, "sha256": v3.sha256, "size": v3.size, "format": "gguf"}
    assert up.apply({**_desired(v2, 3), "window": opened, "prefetch": prefetch}) == "ACTIVE"
    assert activated == ["1.0.0", "1.1.0"] and not any(s["state"] == "DOWNLOADING" for s in states[-3:])
    assert (tmp_path / "d" / "models" / v3.sha256).exists() and activated[-1] == "1.1.0"  # v3 held, not served
    assert states[-1]["prefetch"] == "tiny@1.2.0" and states[-1]["prefetch_state"] == "READY"
    assert states[-1]["state"] == "ACTIVE" and states[-1]["desired"] == "tiny@1.1.0"
    up.close()


def test_a_version_fetched_ahead_switches_on_the_metadata_it_was_verified_against_while_that_is_recent(
        three_versions, tmp_path):
    v1, v2, _ = three_versions.manifests
    ahead = {"model": v2.name, "version": v2.version, "sha256": v2.sha256, "size": v2.size, "format": "gguf"}
    for trust_s, refreshes in ((600.0, 0), (0.0, 1)):  # recent: no second refresh; too old: refreshed first
        up, states = _updater(three_versions, tmp_path / f"d{trust_s}", prefetch_trust_s=trust_s)
        assert up.apply({**_desired(v1, 1), "prefetch": ahead}) == "ACTIVE"
        assert states[-1]["prefetch_state"] == "READY"
        metadata: list[str] = []
        up.http.event_hooks["request"] = [lambda r, seen=metadata: seen.append(r.url.path)]
        assert up.apply(_desired(v2, 2)) == "ACTIVE" and states[-1]["model"] == "tiny@1.1.0"
        assert len([p for p in metadata if p.endswith("/v1/tuf/timestamp.json")]) == refreshes, metadata
        up.close()
