"""``cascade demo``'s staged rollouts: four simulated devices in a group of their own (the demo's
agent, in group demo, keeps the Qwen model it serves), following a small model, SmolLM2-135M, so
that what they download stays small. A good version (Q4_K_M) rolls out wave by wave; a worse one
(a Q2_K, which escalates more) is rolled out next, its escalation gate fails against the devices
not yet updated, and it is rolled back by itself. ``cascade fleet rollout status`` is printed for both.

The simulated devices run the real device side (``DeviceStateClient`` follows the signed desired
state, ``DeviceUpdater`` verifies, downloads and "activates" the file); what they serve is made
up: about 45% of their requests escalate on a Q2_K model and 15% on the others (stated as such in
the output).
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import subprocess
import threading
import time
from pathlib import Path

from cascade_cli.spawn import cascade_command

SIM_ESCALATION = {"Q2_K": 0.45}  # what a simulated device escalates on that quantization (else 0.15)


class SimulatedDevice:
    def __init__(self, name: str, secret: str, fleet, work: Path):
        from model_distribution.device.client import DeviceConfig, DeviceUpdater
        from model_distribution.device.state_client import DeviceStateClient
        from model_distribution.protocol.topics import topic

        keys = fleet.home / "fleet"
        self.name, self.topic = name, topic("default", name, "telemetry")
        self._wanted: queue.Queue = queue.Queue()
        self.client = DeviceStateClient(fleet.broker, "default", name,
                                        bytes.fromhex((keys / "keys" / "desired.pub").read_text().strip()),
                                        self._wanted.put, name, secret)
        config = DeviceConfig(name, fleet.url, (keys / "tuf" / "1.root.json").read_bytes(), work / "sims" / name,
                              secret=secret)
        self.updater = DeviceUpdater(config, self.client.report, self._activate)
        self.quantization = None
        self._stop = threading.Event()
        self._counts = {"requests": 0, "cloud": 0, "record": 0}
        self._started = time.time()
        threading.Thread(target=self._apply, daemon=True, name=f"sim-{name}").start()
        threading.Thread(target=self._serve, daemon=True, name=f"sim-serve-{name}").start()
        self.client.start()

    def _apply(self) -> None:
        while (payload := self._wanted.get()) is not None:
            while not self._wanted.empty():
                payload = self._wanted.get()
            if payload is not None:
                self.updater.apply(payload)

    def _activate(self, path: Path, manifest: dict) -> None:
        self.quantization = manifest.get("quantization")

    def _serve(self) -> None:
        """A telemetry record a second: a few requests each, escalated at its model's made-up rate."""
        while not self._stop.wait(1.0):
            if self.quantization is None:
                continue
            rate = SIM_ESCALATION.get(self.quantization, 0.15)
            for _ in range(random.randint(3, 6)):
                self._counts["requests"] += 1
                self._counts["cloud"] += random.random() < rate
            self._counts["record"] += 1
            c = self._counts
            record = {"id": f"{self.name}-{int(self._started)}-{c['record']}", "kind": "telemetry", "ts": time.time(),
                      "uptime_s": time.time() - self._started, "device": self.name,
                      "decisions": {"cloud/low_confidence": c["cloud"], "edge/easy": c["requests"] - c["cloud"]},
                      "requests": {"/v1/chat/completions/200": c["requests"]}, "queue": {"pending": 0}}
            self.client.link.publish(self.topic, json.dumps(record).encode(), qos=1)

    def stop(self) -> None:
        self._stop.set()
        self._wanted.put(None)
        self.client.stop()
        self.updater.close()


def rollout_scene(fleet, home: str, work: Path) -> None:
    import logging

    from model_distribution.artifacts.catalog import Catalog

    for noisy in ("model_distribution", "sync"):  # the simulated devices' own lines
        logging.getLogger(noisy).setLevel(logging.WARNING)
    print("\n== staged rollouts: four simulated devices in group sims, following smollm2-135m")
    secrets = {f"sim-{i}": json.loads(fleet.run("fleet", "devices", "add", f"sim-{i}", "--group", "sims",
                                                 "--json"))["secret"] for i in range(1, 5)}
    time.sleep(2.0)  # the broker takes new credentials when it reloads (Mosquitto: on SIGHUP, a moment later)
    sims = [SimulatedDevice(name, secret, fleet, work) for name, secret in secrets.items()]
    print("   (simulated devices serve made-up traffic: about 45% escalated on a Q2_K model, 15% on the others)")
    env = {**os.environ, "CASCADE_HOME": home}
    try:
        catalog = Catalog(Path(home))
        fleet.run("fleet", "push", str(catalog.get("smollm2-135m").path), "--name", "smollm2-135m",
                  "--version", "1.1.0", show=True)
        for s in sims:
            fleet.run("fleet", "assign", s.name, "smollm2-135m@1.1.0")
        _wait(lambda: all(((d.get("reported") or {}).get("state") == "ACTIVE" and
                           (d.get("reported") or {}).get("model") == "smollm2-135m@1.1.0")
                          for d in json.loads(fleet.run("fleet", "devices", "--json")) if d["device"] in secrets), 300)
        for kind in ("q4_k_m", "q2_k"):
            print(f"-- $ cascade models quantize smollm2-135m --type {kind}")
            subprocess.run([*cascade_command(log_level=None), "models", "quantize", "smollm2-135m", "--type", kind],
                           env=env, check=True, capture_output=True)
        good = Catalog(Path(home))
        fleet.run("fleet", "push", str(good.get("smollm2-135m-q4_k_m").path), "--name", "smollm2-135m",
                  "--version", "1.2.0", show=True)
        fleet.run("fleet", "push", str(good.get("smollm2-135m-q2_k").path), "--name", "smollm2-135m",
                  "--version", "1.3.0", show=True)
        gates = ["--waves", "40,100", "--bake", "15s", "--gate", "escalation_rate<=+0.10", "--min-requests", "20"]
        for ref in ("smollm2-135m@1.2.0", "smollm2-135m@1.3.0"):
            out = fleet.run("fleet", "rollout", "start", ref, "--group", "sims", *gates, show=True)
            rid = re.search(r"rollout (\S+) started", out).group(1)
            _wait(lambda rid=rid: json.loads(fleet.run("fleet", "rollout", "status", rid, "--json"))["state"]
                  not in ("RUNNING",), 600)
            fleet.run("fleet", "rollout", "status", rid, show=True)
        fleet.run("fleet", "devices", show=True)
    finally:
        for s in sims:
            s.stop()


def _wait(done, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise RuntimeError(f"gave up after {timeout_s:.0f} s")
        time.sleep(1.0)
