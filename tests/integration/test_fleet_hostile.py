"""The hostile-device harness (issue 36): a device with its own enrolled credentials sends what the
issue's attacker sent and whatever Hypothesis draws over the report, telemetry and event schemas,
while a rollout is in flight; the control plane must keep recording the other devices, reach the
verdict it reaches without the hostile device, and answer every operator view.

The in-process property runs the codec, the inbox and the store over hundreds of drawn payloads;
the rollout runs `cascade fleet serve` with its own broker, both kinds, against the same rollout
without the hostile device (a version that fails half its requests: rolled back by its gate)."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import HealthCheck, given, settings

from model_distribution.control_plane.inbox import DeviceInbox
from model_distribution.control_plane.metrics import registry_for
from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from model_distribution.rollout.commands import device_rows
from model_distribution.rollout.store import RolloutStore
from tests import loopback
from tests.hostile import REPRODUCED, HostileDevice, SimDevice, payloads
from tests.integration.test_fleet_attacks import BROKERS, cli, strict_json
from tests.unit.sync.test_mqtt import wait_until
from tests.unit.test_registry import make_gguf


def test_no_drawn_message_raises_refuses_silently_or_breaks_a_view(tmp_path):
    from prometheus_client import generate_latest

    store, rollouts = DeviceStore(tmp_path), RolloutStore(tmp_path)
    store.add("hostile", [])
    store.add("honest", [])
    metrics = registry_for(store, rollouts)
    inbox = DeviceInbox(store, metrics, rate=1e9, burst=1e9)  # no rate limit here: every message reaches the codec
    seen: dict[str, int] = {}

    @settings(max_examples=400, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck),
              database=None)
    @given(message=payloads())
    def one(message):
        kind, payload = message
        outcome = inbox.handle("default", "hostile", kind, payload)
        seen[outcome] = seen.get(outcome, 0) + 1
        n = sum(seen.values())
        assert inbox.handle("default", "honest", "reported", json.dumps({"state": "ACTIVE", "rev": n}).encode()) \
            == "recorded"
        assert store.get("honest").reported["rev"] == n

    for kind, payload in REPRODUCED:
        assert inbox.handle("default", "hostile", kind, payload) not in ("recorded", "duplicate")
    one()
    json.dumps(device_rows(store, rollouts), allow_nan=False)  # the operators' views, strict JSON
    assert generate_latest(metrics)
    refused = sum(v for k, v in seen.items() if k not in ("recorded", "duplicate", "held"))
    assert refused > 100 and seen.get("recorded", 0) >= 5, seen  # the schemas were reached both ways
    assert "error" not in seen  # nothing a device sent surprised the code
    store.close()
    rollouts.close()


def run_rollout(tmp_path, prefer: str, hostile: bool) -> dict:
    """Six honest devices on 1.0.0 (and the hostile one, with ``hostile``), a rollout of 1.1.0 (which
    fails half its requests) in waves 50,100 gated on error_rate<=+0.05; returns what happened."""
    from tests.conftest import Server

    home = tmp_path / ("hostile" if hostile else "honest") / prefer
    assert cli(home, "keys", "init").returncode == 0
    reg = Registry(home / "fleet")
    v1, _ = reg.push(make_gguf(tmp_path / "a.gguf", 1.0), "tiny", "1.0.0")
    v2, _ = reg.push(make_gguf(tmp_path / "b.gguf", 2.0), "tiny", "1.1.0")
    reg.close()
    repo = Repository(home / "fleet")
    for m in (v1, v2):
        repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
    names = [f"d{i}" for i in range(6)] + (["hostile"] if hostile else [])
    secrets = {d: strict_json(cli(home, "devices", "add", d, "--group", "g", "--json").stdout)["secret"]
               for d in names}
    port = _free()
    plane = Server(home, ["fleet", "serve"], "--mqtt-port", str(port),
                   env={"CASCADE_FLEET_MQTT_PREFER": prefer, "CASCADE_FLEET_SERVER_ROLLOUT_TICK_S": "0.2"})
    plane.wait_healthy(60)
    url = f"mqtt://127.0.0.1:{port}"
    rates = {v1.sha256: 0.0, v2.sha256: 0.5}
    devices = [(HostileDevice if d == "hostile" else SimDevice)(url, d, secrets[d], repo.desired_public_key(),
                                                                 rates).start() for d in names]
    out: dict = {}
    try:
        assert cli(home, "assign", "--group", "g", "tiny@1.0.0").returncode == 0
        wait_until(lambda: all(d.sha256 == v1.sha256 for d in devices), "every device on 1.0.0", 60)
        start = cli(home, "rollout", "start", "tiny@1.1.0", "--group", "g", "--waves", "50,100", "--bake", "3",
                    "--gate", "error_rate<=+0.05", "--min-requests", "20")
        assert start.returncode == 0, start.stderr
        rid = start.stdout.split()[1]  # "rollout r-... started: ..."
        hostile_device = next((d for d in devices if isinstance(d, HostileDevice)), None)
        deadline, sent = time.monotonic() + 90, 0
        while True:
            status = strict_json(cli(home, "rollout", "status", rid, "--json").stdout)
            if status["state"] not in ("RUNNING",) or time.monotonic() > deadline:
                break
            if hostile_device is not None:
                sent += attack(hostile_device)
            for view in ("/v1/fleet/devices", "/metrics", "/healthz", f"/v1/fleet/rollouts/{rid}"):
                r = loopback.get(f"{plane.url}{view}", timeout=10)
                assert r.status_code == 200, (view, r.status_code, r.text[:300])
            strict_json(cli(home, "devices", "--json").stdout)
            time.sleep(0.5)
        honest = {r["device"]: r for r in strict_json(cli(home, "devices", "--json").stdout)
                  if r["device"] != "hostile"}
        out = {"state": status["state"], "reason": status["reason"], "sent": sent,
               "honest_reported": all((r["reported"] or {}).get("state") == "ACTIVE" for r in honest.values()),
               "decisions": [(d["outcome"], [g["passed"] for g in d.get("gates", [])]) for d in status["decisions"]],
               "metrics": loopback.get(f"{plane.url}/metrics", timeout=10).text}
    finally:
        for d in devices:
            d.stop()
        plane.stop()
    return out


def attack(device: HostileDevice) -> int:
    """One round of the attack: what the issue's attacker sent, and a batch Hypothesis draws."""
    for kind, payload in REPRODUCED:
        device.send(kind, payload)

    @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(message=payloads())
    def send(message):
        device.send(*message)

    send()
    device.say_state()
    return len(REPRODUCED) + 25


def _free() -> int:
    from cascade.processes import free_port

    return free_port()


@pytest.fixture(scope="module")
def without_hostile(tmp_path_factory):
    return run_rollout(tmp_path_factory.mktemp("baseline"), "embedded", hostile=False)


@pytest.mark.parametrize("prefer", BROKERS)
def test_a_hostile_device_changes_neither_the_verdict_nor_what_the_control_plane_records(
        tmp_path, prefer, without_hostile):
    from model_distribution.control_plane.broker import find_mosquitto

    if prefer == "mosquitto" and find_mosquitto() is None:
        pytest.skip("needs mosquitto (apt-get install mosquitto)")
    assert without_hostile["state"] == "ROLLED_BACK", without_hostile
    got = run_rollout(tmp_path, prefer, hostile=True)
    assert got["state"] == without_hostile["state"] and "error_rate" in got["reason"], got["reason"]
    assert got["decisions"] == without_hostile["decisions"]
    assert got["honest_reported"] and got["sent"] > 0
    assert "cascade_fleet_device_messages_refused_total" in got["metrics"]
