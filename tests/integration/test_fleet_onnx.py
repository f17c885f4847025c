"""An ONNX export in the fleet: `cascade fleet push DIR` publishes the directory as one signed tar
(format onnx), `cascade fleet serve` on a real Mosquitto assigns it to a real agent that runs
llama.cpp; the agent verifies, unpacks and switches to it on the ONNX backend (the device client
picked the backend from the manifest's format) and serves it. A version whose tar was tampered
with on the server is refused and the ONNX model keeps serving; a restart comes back on the ONNX
version (unpacked again if its directory is gone); a GGUF version assigned next switches the agent
back to llama.cpp, both versions kept on disk."""

from __future__ import annotations

import json
import os
import shutil

import httpx
import pytest

from model_distribution.artifacts.onnx_model import pack_onnx_dir
from model_distribution.registry.signing import Repository
from tests import loopback
from tests.conftest import Agent, Server
from tests.integration.test_fleet_agent import fleet
from tests.unit.sync.test_mqtt import MOSQUITTO, Mosquitto, wait_until

pytest.importorskip("onnxruntime_genai")
pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")


def push(home, path, version: str) -> dict:
    r = fleet(home, "push", str(path), "--name", "edge-model", "--version", version, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def served(agent) -> dict:
    return loopback.get(f"{agent.url}/v1/models").json()["data"][0]


def ask(agent) -> httpx.Response:
    return loopback.post(f"{agent.url}/v1/chat/completions", timeout=120, json={
        "model": "edge-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0,
        "logprobs": True, "cascade": {"mode": "local"}})


def test_an_onnx_export_is_pushed_assigned_and_served_by_an_agent_that_ran_llama_cpp(tmp_path, onnx_export,
                                                                                   smollm2_path):
    export = onnx_export("int4")
    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    home = tmp_path / "control"
    not_export = tmp_path / "not-an-export"
    not_export.mkdir()
    (not_export / "model.onnx").write_bytes(b"\x08")
    r = fleet(home, "push", str(not_export), "--name", "edge-model", "--version", "0.9.0")
    assert r.returncode == 2 and "has no genai_config.json" in r.stderr, r.stderr
    v1 = push(home, smollm2_path, "1.0.0")
    v2 = push(home, export, "2.0.0")
    assert (v2["format"], v2["quantization"], v2["architecture"]) == ("onnx", "int4", "llama")
    assert v2["sha256"] == pack_onnx_dir(export, tmp_path / "packed.tar")[0]  # the export's own tar
    bad = tmp_path / "v3"  # another export (one more file), whose tar is then tampered with on the server
    shutil.copytree(export, bad)
    (bad / "notes.txt").write_text("v3\n")
    v3 = push(home, bad, "3.0.0")
    stored = home / "fleet" / "artifacts" / "sha256" / v3["sha256"]
    with open(stored, "r+b") as f:
        f.seek(-(1 << 20), os.SEEK_END)  # one byte of its files: same length, other bytes
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))

    url = f"mqtt://127.0.0.1:{broker.port}"
    plane = Server(home, ["fleet", "serve"], "--broker", url).wait_healthy(60)
    secret = json.loads(fleet(home, "devices", "add", "kiosk-7", "--json").stdout)["secret"]
    device_home = tmp_path / "device"
    device_home.mkdir()
    repo = Repository(home / "fleet")  # what fleet push made
    env = {"CASCADE_EDGE_FLEET_BROKER": url, "CASCADE_EDGE_FLEET_DEVICE_ID": "kiosk-7",
           "CASCADE_EDGE_FLEET_SECRET": secret, "CASCADE_EDGE_FLEET_CONTROL_PLANE": plane.url,
           "CASCADE_EDGE_FLEET_TRUST_ROOT": str(repo.metadata_dir / "1.root.json"),
           "CASCADE_EDGE_FLEET_DESIRED_KEY": str(repo.desired_key_file)}
    models = device_home / "edge" / "fleet" / "models"

    def start_agent() -> Agent:
        return Agent(device_home, "--n-ctx", "512", "--threads", "1", "--parallel", "1", "--no-config",
                     env=env).wait_healthy()

    def reported() -> dict:
        return json.loads(fleet(home, "devices", "--json").stdout)[0]["reported"] or {}

    def assign(version: str, final=("ACTIVE", "FAILED", "REJECTED")) -> dict:
        assert fleet(home, "assign", "kiosk-7", f"edge-model@{version}").returncode == 0
        wait_until(lambda: reported().get("desired") == f"edge-model@{version}" and reported().get("state") in final,
                   f"edge-model@{version}", 240)
        return reported()

    agent = start_agent()
    try:
        assert served(agent)["meta"]["format"] == "gguf"  # the configured model, on llama.cpp
        state = assign("2.0.0")
        assert state["state"] == "ACTIVE" and state["sha256"] == v2["sha256"], state
        card = served(agent)
        assert (card["id"], card["meta"]["format"], card["meta"]["quantization"]) == ("edge-model", "onnx", "int4")
        r = ask(agent)
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"], r.text
        assert r.json()["choices"][0]["logprobs"]["content"][0]["logprob"] <= 0
        assert (models / f"{v2['sha256']}.d" / "genai_config.json").is_file()

        state = assign("3.0.0")  # the tampered tar
        assert state["state"] == "FAILED" and "does not match its signed target" in state["reason"], state
        assert state["model"] == "edge-model@2.0.0" and state.get("retry") is False, state
        assert served(agent)["meta"]["format"] == "onnx" and ask(agent).status_code == 200  # v2 still serves
        assert not (models / v3["sha256"]).exists() and not (models / f"{v3['sha256']}.d").exists()
        assert not list((device_home / "edge" / "fleet" / "staging").glob("*"))

        agent.stop()
        shutil.rmtree(models / f"{v2['sha256']}.d")  # the unpacked files lost: the checked tar is unpacked again
        agent = start_agent()
        card = served(agent)
        assert (card["id"], card["meta"]["format"]) == ("edge-model", "onnx")
        assert ask(agent).status_code == 200

        state = assign("1.0.0")  # a GGUF version: back on llama.cpp
        assert state["state"] == "ACTIVE" and state["sha256"] == v1["sha256"], state
        assert served(agent)["meta"]["format"] == "gguf" and ask(agent).status_code == 200
        assert sorted(p.name for p in models.iterdir()) == sorted([v1["sha256"], v2["sha256"], f"{v2['sha256']}.d"])
    finally:
        agent.stop()
        plane.stop()
        broker.stop()
