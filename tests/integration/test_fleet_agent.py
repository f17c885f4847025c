"""A real edge agent (llama.cpp) in a fleet: the control plane (`cascade fleet serve` on a real
Mosquitto) assigns it a new version of its model; the agent verifies, downloads and switches
while it serves: a stream running across the switch completes on the old model, requests after
it are served by the new one under the fleet's name, no request fails, and the device reports
ACTIVE with the new digest. The second version is the first's file with one weight byte changed
(a different artifact that loads the same way)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time

import pytest

from cascade_cli.spawn import cascade_command
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from sync.mqtt_link import stop_loop
from tests import loopback
from tests.conftest import REPO, Agent, Server
from tests.unit.sync.test_mqtt import MOSQUITTO, Mosquitto, wait_until

pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")


def fleet(home, *args):
    return subprocess.run(cascade_command("fleet", *args, log_level=None), cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "CASCADE_HOME": str(home)}, timeout=60)


def device_env(broker: str, device: str, secret: str, control_plane: str, repo: Repository) -> dict:
    """An agent's [fleet] section, as the environment gives it."""
    return {"CASCADE_EDGE_FLEET_BROKER": broker, "CASCADE_EDGE_FLEET_DEVICE_ID": device,
            "CASCADE_EDGE_FLEET_SECRET": secret, "CASCADE_EDGE_FLEET_CONTROL_PLANE": control_plane,
            "CASCADE_EDGE_FLEET_TRUST_ROOT": str(repo.metadata_dir / "1.root.json"),
            "CASCADE_EDGE_FLEET_DESIRED_KEY": str(repo.desired_key_file)}


def control_plane(tmp_path, smollm2_path, tail: bytes):
    """A started Mosquitto, a fleet home with keys, and a second version of the model: its file
    with the last bytes changed (a different artifact that loads the same way)."""
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    home = tmp_path / "control"
    repo = Repository(home / "fleet")
    repo.init()
    v2_file = tmp_path / "v2.gguf"
    shutil.copyfile(smollm2_path, v2_file)
    with open(v2_file, "r+b") as f:
        f.seek(-len(tail), os.SEEK_END)
        f.write(tail)
    return broker, home, repo, v2_file


def test_an_agent_switches_to_its_assigned_version_while_it_serves(tmp_path, smollm2_path):
    broker, home, repo, v2_file = control_plane(tmp_path, smollm2_path, b"\x01\x02\x03")
    cal = tmp_path / "edge.toml"
    cal.write_text("[cascade]\nhold_tokens = 8\n")
    reg = Registry(home / "fleet")
    v1, _ = reg.push(smollm2_path, "edge-model", "1.0.0")
    v2, _ = reg.push(v2_file, "edge-model", "1.1.0", calibration=cal)
    reg.close()
    for m in (v1, v2):
        repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
    url = f"mqtt://127.0.0.1:{broker.port}"
    plane = Server(home, ["fleet", "serve"], "--broker", url).wait_healthy(60)
    secret = json.loads(fleet(home, "devices", "add", "kiosk-5", "--group", "kiosks", "--json").stdout)["secret"]
    (tmp_path / "device").mkdir()
    agent = Agent(tmp_path / "device", "--n-ctx", "512", "--threads", "1", "--parallel", "1", "--no-config", env={
        "CASCADE_EDGE_FLEET_BROKER": url, "CASCADE_EDGE_FLEET_DEVICE_ID": "kiosk-5",
        "CASCADE_EDGE_FLEET_SECRET": secret, "CASCADE_EDGE_FLEET_CONTROL_PLANE": plane.url,
        "CASCADE_EDGE_FLEET_TRUST_ROOT": str(repo.metadata_dir / "1.root.json"),
        "CASCADE_EDGE_FLEET_DESIRED_KEY": str(repo.desired_key_file),
        "CASCADE_EDGE_MQTT_TELEMETRY_INTERVAL_S": "1"}).wait_healthy()
    try:
        results: dict = {}

        def long_stream():
            body = {"model": "smollm2-135m", "prompt": "Once upon a time", "max_tokens": 120, "temperature": 0,
                    "stream": True, "cascade": {"mode": "local"}}
            with loopback.stream("POST", f"{agent.url}/v1/completions", json=body, timeout=300) as r:
                results["status"] = r.status_code
                results["lines"] = [ln for ln in r.iter_lines() if ln.startswith("data:")]

        t = threading.Thread(target=long_stream)
        t.start()
        time.sleep(0.5)
        assert fleet(home, "assign", "kiosk-5", "edge-model@1.1.0").returncode == 0

        def reported():
            return json.loads(fleet(home, "devices", "--json").stdout)[0]["reported"] or {}

        wait_until(lambda: reported().get("state") in ("ACTIVE", "FAILED", "REJECTED"), "the switch", 240)
        assert reported()["state"] == "ACTIVE" and reported()["sha256"] == v2.sha256, reported()
        t.join(300)
        assert results["status"] == 200 and results["lines"][-1] == "data: [DONE]"
        assert not any('"error"' in ln for ln in results["lines"])  # the stream across the switch completed
        models = loopback.get(f"{agent.url}/v1/models").json()["data"]
        assert models[0]["id"] == "edge-model"
        for name in ("edge-model", "smollm2-135m"):  # the fleet's name, and the old one still answers
            r = loopback.post(f"{agent.url}/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 4,
                                                               "cascade": {"mode": "local"}}, timeout=120)
            assert r.status_code == 200, r.text

        def listed():  # telemetry through the fleet broker, as the device: what `fleet devices` shows
            return json.loads(fleet(home, "devices", "--json").stdout)[0]

        wait_until(lambda: (listed().get("requests") or 0) >= 3, "the device's telemetry", 60)
        row = listed()
        assert row["online"] is True and row["escalation_rate"] == 0.0 and row["error_rate"] == 0.0, row
        assert row["backlog"] == 0
    finally:
        agent.stop()
        plane.stop()
        broker.stop()


def test_an_agent_killed_mid_download_and_mid_switch_comes_back_on_one_model_and_converges(tmp_path, smollm2_path):
    """kill -9 while the new version downloads (through a slow link): the next start resumes from
    the bytes it has (a Range request). kill -9 while it switches: it comes back on one model and
    goes on to ACTIVE. Killed once ACTIVE: it starts on the new version at once."""
    import paho.mqtt.client as mqtt

    from tests.faults import Proxy

    broker, home, repo, v2_file = control_plane(tmp_path, smollm2_path, b"\x03\x02\x01")
    reg = Registry(home / "fleet")
    v2, _ = reg.push(v2_file, "edge-model", "2.0.0")
    reg.close()
    repo.add_target(v2.name, v2.version, v2.sha256, v2.size, v2.signable())
    url = f"mqtt://127.0.0.1:{broker.port}"
    plane = Server(home, ["fleet", "serve"], "--broker", url).wait_healthy(60)
    link = Proxy(plane.port).up()
    link.rate = 15e6  # bytes/s: the download takes seconds, long enough to be interrupted
    secret = json.loads(fleet(home, "devices", "add", "kiosk-6", "--json").stdout)["secret"]
    device_home = tmp_path / "device"
    device_home.mkdir()
    env = device_env(url, "kiosk-6", secret, link.url, repo)
    states: list[dict] = []
    watcher = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="test-watcher")
    watcher.on_message = lambda c, u, m: states.append(json.loads(m.payload))
    watcher.connect("127.0.0.1", broker.port)
    watcher.subscribe("cascade/v1/default/devices/kiosk-6/reported", qos=1)
    watcher.loop_start()

    def start_agent() -> Agent:
        return Agent(device_home, "--n-ctx", "512", "--threads", "1", "--parallel", "1", "--no-config",
                     env=env).wait_healthy()

    def kill(a: Agent) -> None:
        os.killpg(a.proc.pid, 9)
        a.proc.wait(10)
        a.stop()

    part = device_home / "edge" / "fleet" / "staging" / f"{v2.sha256}.part"
    agent = start_agent()
    try:
        assert fleet(home, "assign", "kiosk-6", "edge-model@2.0.0").returncode == 0
        wait_until(lambda: part.exists() and part.stat().st_size > v2.size // 4, "a quarter downloaded", 120)
        kill(agent)
        had = part.stat().st_size
        assert 0 < had < v2.size
        link.rate = 0
        states.clear()
        agent = start_agent()
        wait_until(lambda: any(s.get("state") == "ACTIVATING" for s in states), "the switch to start", 120)
        resumed = [rng for line, rng in link.requests if f"/v1/artifacts/{v2.sha256}" in line and rng]
        assert resumed and int(resumed[-1].removeprefix("bytes=").rstrip("-")) >= had, link.requests
        kill(agent)  # mid-switch: the new file is in place, the agent had not switched yet
        agent = start_agent()
        served = loopback.get(f"{agent.url}/v1/models").json()["data"]
        assert len(served) == 1 and served[0]["id"] in ("smollm2-135m", "edge-model"), served  # one model
        wait_until(lambda: states and states[-1].get("state") == "ACTIVE", "ACTIVE after the kill", 120)
        assert states[-1]["sha256"] == v2.sha256, states[-1]
        assert loopback.get(f"{agent.url}/v1/models").json()["data"][0]["id"] == "edge-model"
        assert not list((device_home / "edge" / "fleet" / "staging").glob("*"))  # nothing half-done left
        kill(agent)  # once ACTIVE, the next start serves the new version from the start
        states.clear()
        agent = start_agent()
        assert loopback.get(f"{agent.url}/v1/models").json()["data"][0]["id"] == "edge-model"
        r = loopback.post(f"{agent.url}/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4,
                                                           "cascade": {"mode": "local"}}, timeout=120)
        assert r.status_code == 200, r.text  # the name apps were configured with still answers
        wait_until(lambda: states and states[-1].get("state") == "ACTIVE", "ACTIVE reported again", 60)
        assert states[-1]["sha256"] == v2.sha256 and not any(s.get("state") == "DOWNLOADING" for s in states)
    finally:
        stop_loop(watcher)
        agent.stop()
        link.down()
        plane.stop()
        broker.stop()


def test_a_real_agent_takes_part_in_a_staged_rollout_beside_simulated_devices_and_serves_throughout(
        tmp_path, smollm2_path):
    """Three simulated devices (the real device client, file artifacts) and a real agent in one
    group; a 3-wave rollout moves them all to the new version while an app keeps calling the agent:
    every request answers, the rollout SUCCEEDED, the agent serves the new version."""
    import types

    from model_distribution.fleet.devices import DeviceStore
    from model_distribution.rollout.controller import start_rollout
    from model_distribution.rollout.spec import RolloutSpec
    from model_distribution.rollout.store import RolloutStore
    from tests.integration.test_fleet_devices import SimDevice

    broker, home, repo, v2_file = control_plane(tmp_path, smollm2_path, b"\x07\x07\x07")
    root = home / "fleet"
    reg = Registry(root)
    v1, _ = reg.push(smollm2_path, "edge-model", "1.0.0")
    v2, _ = reg.push(v2_file, "edge-model", "1.1.0")
    for m in (v1, v2):
        repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
    url = f"mqtt://127.0.0.1:{broker.port}"
    plane = Server(home, ["fleet", "serve"], "--broker", url,
                   env={"CASCADE_FLEET_SERVER_ROLLOUT_TICK_S": "0.2"}).wait_healthy(60)
    store = DeviceStore(root)
    secrets_ = {name: store.add(name, ["kiosks"]) for name in ("agent-1", "sim-1", "sim-2", "sim-3")}
    world = types.SimpleNamespace(downloading=threading.Event(), broker_url=url, public_key=repo.desired_public_key(),
                                  http=plane.url, root_json=repo.root_bytes(), tmp=tmp_path)
    sims = [SimDevice(name, secrets_[name], world) for name in ("sim-1", "sim-2", "sim-3")]
    for s in sims:
        s.client.start()
    (tmp_path / "device").mkdir()
    agent = Agent(tmp_path / "device", "--n-ctx", "512", "--threads", "1", "--parallel", "1", "--no-config", env={
        "CASCADE_EDGE_FLEET_BROKER": url, "CASCADE_EDGE_FLEET_DEVICE_ID": "agent-1",
        "CASCADE_EDGE_FLEET_SECRET": secrets_["agent-1"], "CASCADE_EDGE_FLEET_CONTROL_PLANE": plane.url,
        "CASCADE_EDGE_FLEET_TRUST_ROOT": str(repo.metadata_dir / "1.root.json"),
        "CASCADE_EDGE_FLEET_DESIRED_KEY": str(repo.desired_key_file)}).wait_healthy()
    answers: list[int] = []
    stop = threading.Event()

    def app():  # an app on the device calling it all along
        while not stop.is_set():
            body = {"model": "smollm2-135m", "prompt": "Hello", "max_tokens": 8, "stream": True,
                    "cascade": {"mode": "local"}}
            with loopback.stream("POST", f"{agent.url}/v1/completions", json=body, timeout=120) as r:
                lines = [ln for ln in r.iter_lines() if ln.startswith("data:")]
                answers.append(r.status_code if lines and lines[-1] == "data: [DONE]" else -1)

    caller = threading.Thread(target=app)
    caller.start()
    rollouts = RolloutStore(root)
    try:
        store.assign(v1, group="kiosks")

        def all_on(m):
            return all((d.reported or {}).get("state") == "ACTIVE" and (d.reported or {}).get("sha256") == m.sha256
                       for d in store.list(group="kiosks"))

        wait_until(lambda: all_on(v1), "the group on 1.0.0", 240)
        r = start_rollout(reg, store, rollouts, RolloutSpec("edge-model@1.1.0", "kiosks", [25, 50, 100]))
        wait_until(lambda: rollouts.get(r.rollout_id).state != "RUNNING", "the rollout", 300)
        done = rollouts.get(r.rollout_id)
        assert done.state == "SUCCEEDED", (done.reason, [e.to_dict() for e in rollouts.executions(r.rollout_id)])
        assert all_on(v2)
        assert [d["outcome"] for d in rollouts.decisions(r.rollout_id)] == ["pass"] * 3
        stop.set()
        caller.join(120)
        assert answers and set(answers) == {200}, answers  # it served throughout, two switches included
        assert loopback.get(f"{agent.url}/v1/models").json()["data"][0]["id"] == "edge-model"
    finally:
        stop.set()
        caller.join(120)
        for s in sims:
            s.stop()
        agent.stop()
        plane.stop()
        broker.stop()
        rollouts.close()
        store.close()
        reg.close()


def test_a_version_whose_calibration_cannot_be_applied_leaves_the_old_model_serving_across_a_restart(
        tmp_path, smollm2_path):
    """Issue 36, item 13: a version whose calibration a device cannot apply (here as an older
    control plane published it, naming a difficulty model on the calibrating host) is loaded and
    smoke-tested, then refused before the switch: FAILED with the reason, the old model answers
    every request, and a restart comes back on it, not on a half-switched agent answering 500."""
    broker, home, repo, v2_file = control_plane(tmp_path, smollm2_path, b"\x04\x05\x06")
    reg = Registry(home / "fleet")
    v2, _ = reg.push(v2_file, "edge-model", "3.0.0")
    legacy = {"hold_tokens": 8, "difficulty_model": "/home/calibrator/difficulty.json"}
    reg._db.execute("UPDATE model_versions SET calibration = ? WHERE name = 'edge-model'", (json.dumps(legacy),))
    v2 = reg.get("edge-model", "3.0.0")
    reg.close()
    repo.add_target(v2.name, v2.version, v2.sha256, v2.size, v2.signable())  # signed as such
    url = f"mqtt://127.0.0.1:{broker.port}"
    plane = Server(home, ["fleet", "serve"], "--broker", url).wait_healthy(60)
    secret = json.loads(fleet(home, "devices", "add", "kiosk-9", "--json").stdout)["secret"]
    device_home = tmp_path / "device"
    device_home.mkdir()
    env = device_env(url, "kiosk-9", secret, plane.url, repo)

    def start_agent() -> Agent:
        return Agent(device_home, "--n-ctx", "512", "--threads", "1", "--parallel", "1", "--no-config",
                     env=env).wait_healthy()

    def answers(agent: Agent) -> None:
        r = loopback.post(f"{agent.url}/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi",
                                                               "max_tokens": 4, "cascade": {"mode": "local"}},
                          timeout=120)
        assert r.status_code == 200, r.text
        assert loopback.get(f"{agent.url}/v1/models").json()["data"][0]["id"] == "smollm2-135m"

    def reported():
        return json.loads(fleet(home, "devices", "--json").stdout)[0]["reported"] or {}

    agent = start_agent()
    try:
        assert fleet(home, "assign", "kiosk-9", "edge-model@3.0.0").returncode == 0
        wait_until(lambda: reported().get("state") in ("FAILED", "ACTIVE"), "the switch to be decided", 240)
        assert reported()["state"] == "FAILED" and "calibration" in reported()["reason"], reported()
        answers(agent)
        agent.stop()
        agent = start_agent()  # the retained document is taken again: refused again, the old model serves
        answers(agent)
        assert not (device_home / "edge" / "fleet" / "active.json").exists()
    finally:
        agent.stop()
        plane.stop()
        broker.stop()
