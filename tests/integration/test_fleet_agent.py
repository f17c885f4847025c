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

import httpx
import pytest

from cascade.processes import cascade_command
from model_distribution.registry import Registry
from model_distribution.signing import Repository
from tests.conftest import REPO, Agent, Server
from tests.unit.sync.test_mqtt import MOSQUITTO, Mosquitto, wait_until

pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")


def fleet(home, *args):
    return subprocess.run(cascade_command("fleet", *args, log_level=None), cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "CASCADE_HOME": str(home)}, timeout=60)


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
            with httpx.stream("POST", f"{agent.url}/v1/completions", json=body, timeout=300) as r:
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
        models = httpx.get(f"{agent.url}/v1/models").json()["data"]
        assert models[0]["id"] == "edge-model"
        for name in ("edge-model", "smollm2-135m"):  # the fleet's name, and the old one still answers
            r = httpx.post(f"{agent.url}/v1/completions", json={"model": name, "prompt": "Hi", "max_tokens": 4,
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
    env = {"CASCADE_EDGE_FLEET_BROKER": url, "CASCADE_EDGE_FLEET_DEVICE_ID": "kiosk-6",
           "CASCADE_EDGE_FLEET_SECRET": secret, "CASCADE_EDGE_FLEET_CONTROL_PLANE": link.url,
           "CASCADE_EDGE_FLEET_TRUST_ROOT": str(repo.metadata_dir / "1.root.json"),
           "CASCADE_EDGE_FLEET_DESIRED_KEY": str(repo.desired_key_file)}
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
        served = httpx.get(f"{agent.url}/v1/models").json()["data"]
        assert len(served) == 1 and served[0]["id"] in ("smollm2-135m", "edge-model"), served  # one model
        wait_until(lambda: states and states[-1].get("state") == "ACTIVE", "ACTIVE after the kill", 120)
        assert states[-1]["sha256"] == v2.sha256, states[-1]
        assert httpx.get(f"{agent.url}/v1/models").json()["data"][0]["id"] == "edge-model"
        assert not list((device_home / "edge" / "fleet" / "staging").glob("*"))  # nothing half-done left
        kill(agent)  # once ACTIVE, the next start serves the new version from the start
        states.clear()
        agent = start_agent()
        assert httpx.get(f"{agent.url}/v1/models").json()["data"][0]["id"] == "edge-model"
        r = httpx.post(f"{agent.url}/v1/completions", json={"model": "smollm2-135m", "prompt": "Hi", "max_tokens": 4,
                                                           "cascade": {"mode": "local"}}, timeout=120)
        assert r.status_code == 200, r.text  # the name apps were configured with still answers
        wait_until(lambda: states and states[-1].get("state") == "ACTIVE", "ACTIVE reported again", 60)
        assert states[-1]["sha256"] == v2.sha256 and not any(s.get("state") == "DOWNLOADING" for s in states)
    finally:
        watcher.loop_stop()
        agent.stop()
        link.down()
        plane.stop()
        broker.stop()
