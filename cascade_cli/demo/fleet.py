"""The demo's fleet: the control plane (``cascade fleet serve``) with the demo's device enrolled,
and the scene where a bigger model for the device (the 1.5B, for a kiosk that has the memory) is
published, assigned while an answer streams, and the agent switches to it."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import httpx

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.demo.chat import stream_chat
from cascade_cli.spawn import cascade_command


class Fleet:
    """The fleet's control plane (`cascade fleet serve`, with the MQTT broker it starts: Mosquitto
    when installed, else the embedded one) in its own $CASCADE_HOME, and the demo's device enrolled
    in it. The agent follows its desired state and sends its telemetry through that broker."""

    def __init__(self, work: Path, env: dict, device: str):
        self.home, self.device = work / "control", device
        self.env = {**env, "CASCADE_HOME": str(self.home)}
        self.cli = cascade_command(log_level=None)
        self.run("fleet", "keys", "init")
        enrolled = json.loads(self.run("fleet", "devices", "add", device, "--group", "demo", "--json"))
        self.port, mqtt_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.broker = f"mqtt://127.0.0.1:{mqtt_port}"
        self.proc = spawn([*self.cli, "fleet", "serve", "--port", str(self.port), "--mqtt-port", str(mqtt_port)],
                          env=self.env, log=work / "fleet.log", die_with_parent=True)
        wait_healthy(self.url, self.proc, 120, "fleet control plane", log=work / "fleet.log")
        keys = self.home / "fleet" / "tuf"
        self.device_env = {"CASCADE_EDGE_FLEET_BROKER": self.broker, "CASCADE_EDGE_FLEET_FLEET": "default",
                           "CASCADE_EDGE_FLEET_DEVICE_ID": device, "CASCADE_EDGE_FLEET_SECRET": enrolled["secret"],
                           "CASCADE_EDGE_FLEET_CONTROL_PLANE": self.url,
                           "CASCADE_EDGE_FLEET_TRUST_ROOT": str(keys / "1.root.json"),
                           "CASCADE_EDGE_FLEET_DESIRED_KEY": str(self.home / "fleet" / "keys" / "desired.pub"),
                           "CASCADE_EDGE_FLEET_STATE_DIR": str(work / "device-fleet"),
                           "CASCADE_EDGE_MQTT_TELEMETRY_INTERVAL_S": "5"}

    def run(self, *args: str, show: bool = False) -> str:
        if show:
            print(f"-- $ cascade {' '.join(args)}")
        out = subprocess.run([*self.cli, *args], env=self.env, capture_output=True, text=True)
        if out.returncode != 0:
            raise RuntimeError(f"cascade {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
        if show:
            print("   " + out.stdout.strip().replace("\n", "\n   "))
        return out.stdout

    def reported(self) -> dict:
        return json.loads(self.run("fleet", "devices", "--json"))[0]

    def stop(self) -> None:
        stop(self.proc)


FLEET_NAME = "qwen2.5-coder"  # the published model's name: its versions are the 0.5B, then the 1.5B


def fleet_scene(fleet: Fleet, edge: str, home: str, work: Path, serving: str, bigger: str) -> None:
    """Publish two versions of the device's model (the 0.5B it serves, then the 1.5B with its
    calibration), assign the new one while a stream runs, follow the device's reported state."""
    import threading

    from model_distribution.artifacts.catalog import Catalog

    print(f"\n== the fleet: the operator ships the kiosk (it has the memory) the bigger model, {bigger}")
    catalog = Catalog(Path(home))
    calibration = Path(home) / "edge.toml"
    if not calibration.is_file():  # what `cascade calibrate` would write for this model
        calibration = work / "calibration.toml"
        calibration.write_text("[cascade]\nhold_tokens = 8\nmin_mean_logprob = -0.8\n")
    fleet.run("fleet", "push", str(catalog.get(serving).path), "--name", FLEET_NAME, "--version", "1.0.0",
              show=True)
    fleet.run("fleet", "push", str(catalog.get(bigger).path), "--name", FLEET_NAME, "--version",
              "1.1.0", "--calibration", str(calibration), show=True)
    fleet.run("fleet", "models", show=True)
    streamed: dict = {}

    def long_answer():
        streamed.update(stream_chat(edge, serving, "Tell me a long story about a lighthouse keeper.",
                                    {"mode": "local"}, max_tokens=160))

    app = threading.Thread(target=long_answer)
    app.start()
    time.sleep(1.0)
    print("-- app: a long answer is streaming from the device while the new version arrives")
    fleet.run("fleet", "assign", fleet.device, f"{FLEET_NAME}@1.1.0", show=True)
    deadline, last = time.monotonic() + 600, None
    while time.monotonic() < deadline:
        state = (fleet.reported().get("reported") or {})
        if state.get("state") != last:
            last = state.get("state")
            detail = state.get("reason") or (f"{state['done'] >> 20}/{state['total'] >> 20} MiB"
                                             if "done" in state else state.get("model") or "")
            print(f"   device {fleet.device}: {last} {detail}")
        if last in ("ACTIVE", "FAILED", "REJECTED") and state.get("desired") == f"{FLEET_NAME}@1.1.0":
            break
        time.sleep(0.3)
    app.join(600)
    print(f"-- the stream across the switch: {streamed.get('tokens', 0)} tokens, "
          f"{'completed' if streamed.get('tier') else 'failed: ' + str(streamed.get('reason'))}")
    served = httpx.get(f"{edge}/v1/models", timeout=10).json()["data"][0]
    r = stream_chat(edge, serving, "Which city is the capital of France?", None)
    print(f"-- after the switch the agent serves {(fleet.reported().get('reported') or {}).get('model')} "
          f"({(served.get('meta') or {}).get('quantization')}), still under the name {serving!r}; "
          "app: Which city is the capital of France?\n"
          f"-- {r['tier']} ({r['reason']}): {r['text'][:120]}")
    time.sleep(6)  # one more telemetry record reaches the control plane
    fleet.run("fleet", "devices", show=True)
