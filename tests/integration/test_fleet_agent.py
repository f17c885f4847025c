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


def test_an_agent_switches_to_its_assigned_version_while_it_serves(tmp_path, smollm2_path):
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    home = tmp_path / "control"
    repo = Repository(home / "fleet")
    repo.init()
    v2_file = tmp_path / "v2.gguf"
    shutil.copyfile(smollm2_path, v2_file)
    with open(v2_file, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\x01\x02\x03")
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
        "CASCADE_EDGE_FLEET_DESIRED_KEY": str(repo.desired_key_file)}).wait_healthy()
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
    finally:
        agent.stop()
        plane.stop()
        broker.stop()
