"""``cascade demo``: the whole chain on one machine, as a scripted scenario.

A fleet control plane starts first (`cascade fleet serve` and its MQTT broker: Mosquitto when
installed, else an embedded one) and the demo's device is enrolled in it; the agent sends its
telemetry there. While the cloud tier starts, the device is offline: escalations are queued (202)
and delivered once it is up.
Then: a cloud tier (`cascade cloud serve`: gateway + 1 prefill + 1 decode worker, SmolLM2-135M at full
precision on our engine), an edge agent on a harsher Q2_K variant of the same model (derived
with `cascade models quantize`, as a fleet ships a smaller model to devices), the agent's
upstream pointed at the cloud with a device key, then a mix of easy and hard requests, and a
table of who answered what, why, and how fast. Last, the fleet: the device's model is published
in two versions (its Q2_K, then the packaged Q4_1 with calibrated thresholds), the new one is
assigned while the agent streams an answer, the agent switches, and `cascade fleet devices` shows it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
import time
from pathlib import Path

import httpx

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command

# (what the app sends, the cascade options it adds)
SCRIPT = [
    ("Which city is the capital of France?", None),
    ("What is 12 + 30? Answer with just the number.", None),
    ("Write a haiku about the sea.", None),
    ("Explain step by step how a transformer computes attention.", {"hint": "hard"}),
    ("Summarize this log:\n" + "2026-11-30 12:00:01 INFO request served in 42 ms\n" * 40, None),
    ("Name three primary colors.", {"mode": "cloud"}),
    ("Say hello to the factory floor.", {"mode": "local"}),
    ("What is the chemical symbol for gold?", None),
]


def stream_chat(base: str, model: str, prompt: str, cascade: dict | None, max_tokens: int = 48) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    if cascade:
        body["cascade"] = cascade
    start = time.perf_counter()
    first, text, usage, final = None, [], {}, {}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=300) as r:
        headers = r.headers
        if r.status_code != 200:
            r.read()
            message = r.json().get("error", {}).get("message", r.text) if r.text.startswith("{") else r.text
            return {"tier": headers.get("x-cascade-tier", "-"), "reason": f"HTTP {r.status_code}", "degraded": False,
                    "text": message, "tokens": 0, "ttft_ms": float("nan"),
                    "total_ms": (time.perf_counter() - start) * 1000, "confidence": None}
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            usage = chunk.get("usage") or usage
            final = chunk.get("cascade") or final
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    first = first or time.perf_counter()
                    text.append(piece)
    total = time.perf_counter() - start
    return {"tier": headers.get("x-cascade-tier"), "reason": headers.get("x-cascade-reason"),
            "degraded": headers.get("x-cascade-degraded") == "true", "text": "".join(text).strip(),
            "tokens": usage.get("completion_tokens", 0), "ttft_ms": ((first or start + total) - start) * 1000,
            "total_ms": total * 1000, "confidence": final.get("confidence")}


OFFLINE = [("Translate 'good morning' into French.", "kiosk-1/till"),
           ("Write one sentence about the sea.", "kiosk-1/till"),
           ("Name a prime number greater than 10.", "kiosk-1/door")]


def offline_scene(edge: str, db: Path) -> list[tuple[str, str]]:
    """While the cloud is unreachable: requests that must reach it are queued (202 + Location);
    one that may be answered locally is, marked degraded. Returns (prompt, location)."""
    print("\n== the cloud is not reachable yet: escalations follow their offline policy")
    queued = []
    for prompt, session in OFFLINE:
        body = {"model": "smollm2-135m-q2_k", "messages": [{"role": "user", "content": prompt}], "max_tokens": 32,
                "temperature": 0, "cascade": {"mode": "cloud", "offline": "queue", "session": session}}
        r = httpx.post(f"{edge}/v1/chat/completions", json=body, timeout=60)
        print(f"-- app: {prompt}  {{offline: queue, session: {session}}}\n-- {r.status_code} "
              f"{r.headers.get('x-cascade-tier')} ({r.headers.get('x-cascade-reason')}), "
              f"Location: {r.headers.get('location')}")
        if r.status_code == 202:
            queued.append((prompt, r.headers["location"]))
    r = stream_chat(edge, "smollm2-135m-q2_k", "Is the store open today?", {"mode": "cloud", "offline": "local"})
    print(f"-- app: Is the store open today?  {{offline: local}}\n-- {r['tier']} ({r['reason']}"
          f"{', degraded' if r['degraded'] else ''}): {r['text'][:120]}")
    print(f"-- $ cascade edge queue --db {db}")
    backlog = subprocess.run(cascade_command("edge", "queue", "--db", str(db), log_level=None),
                             capture_output=True, text=True)
    print("   " + backlog.stdout.strip().replace("\n", "\n   "))
    return queued


def drain(edge: str, queued: list[tuple[str, str]], timeout_s: float = 300) -> None:
    """Poll GET /v1/requests/{id} until every queued request has an answer."""
    deadline, shown = time.monotonic() + timeout_s, set()
    while len(shown) < len(queued) and time.monotonic() < deadline:
        for _, location in queued:
            if location in shown:
                continue
            item = httpx.get(f"{edge}{location}", timeout=10).json()
            if item["state"] in ("done", "failed", "expired"):
                shown.add(location)
                answer = (item.get("response") or {}).get("choices", [{}])[0].get("message", {}).get("content", "")
                print(f"-- {location}: {item['state']} after {item['attempts']} attempt(s), "
                      f"{item['updated_at'] - item['created_at']:.1f} s queued: {answer.strip()[:100]}")
        time.sleep(0.5)
    if len(shown) < len(queued):
        print(f"-- {len(queued) - len(shown)} queued request(s) not delivered in {timeout_s:.0f} s")


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


def fleet_scene(fleet: Fleet, edge: str, home: str, work: Path, serving: str) -> None:
    """Publish two versions of the device's model (the Q2_K it serves, then the packaged Q4_1 with
    its calibration), assign the new one while a stream runs, follow the device's reported state."""
    import threading

    from model_distribution.catalog import Catalog

    print("\n== the fleet: the operator ships a better quantization of the device's model")
    catalog = Catalog(Path(home))
    calibration = Path(home) / "edge.toml"
    if not calibration.is_file():  # what `cascade calibrate` would write for this model
        calibration = work / "calibration.toml"
        calibration.write_text("[cascade]\nhold_tokens = 8\nmin_mean_logprob = -1.4\n")
    fleet.run("fleet", "push", str(catalog.get(serving).path), "--name", "smollm2-135m", "--version", "1.0.0",
              show=True)
    fleet.run("fleet", "push", str(catalog.get("smollm2-135m").path), "--name", "smollm2-135m", "--version",
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
    fleet.run("fleet", "assign", fleet.device, "smollm2-135m@1.1.0", show=True)
    deadline, last = time.monotonic() + 600, None
    while time.monotonic() < deadline:
        state = (fleet.reported().get("reported") or {})
        if state.get("state") != last:
            last = state.get("state")
            detail = state.get("reason") or (f"{state['done'] >> 20}/{state['total'] >> 20} MiB"
                                             if "done" in state else state.get("model") or "")
            print(f"   device {fleet.device}: {last} {detail}")
        if last in ("ACTIVE", "FAILED", "REJECTED") and state.get("desired") == "smollm2-135m@1.1.0":
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


def main(args) -> int:
    home = os.environ.get("CASCADE_HOME") or str(Path.home() / ".cascade")
    work = Path(tempfile.mkdtemp(prefix="cascade-demo-"))
    env = {**os.environ, "CASCADE_HOME": home, "OMP_WAIT_POLICY": "passive",
           "CASCADE_EDGE_SERVER_LOG_LEVEL": "warning", "CASCADE_CLOUD_SERVER_LOG_LEVEL": "warning",
           "CASCADE_CLOUD_GATEWAY_DB": str(work / "gateway.db")}
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cli = cascade_command()

    print("== deriving the edge model: SmolLM2-135M Q4_1 -> Q2_K (cascade models quantize)")
    subprocess.run([*cli, "models", "quantize", "smollm2-135m", "--type", "q2_k"], env=env, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    key = subprocess.run([*cli, "cloud", "keys", "create", "--tenant", "demo", "--device", "kiosk-1",
                          "--db", str(work / "gateway.db")], env=env,
                         check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    cloud_port, edge_port = free_port(), args.port or free_port()
    cloud_url, edge_url = f"http://127.0.0.1:{cloud_port}", f"http://127.0.0.1:{edge_port}"
    print(f"== starting the cloud tier on {cloud_url}: gateway + 1 prefill + 1 decode worker "
          "(first run converts the model, about a minute)")
    cloud = spawn([*cli, "cloud", "serve", "--port", str(cloud_port), "--prefill", "1", "--decode", "1",
                   "--max-model-len", "2048"], env=env, die_with_parent=True)
    edge = fleet = None
    try:
        print("== starting the fleet control plane (cascade fleet serve) and enrolling the device kiosk-1")
        fleet = Fleet(work, env, "kiosk-1")
        print(f"   control plane {fleet.url}, broker {fleet.broker}")
        # the agent starts at once; the cloud takes a while, and meanwhile the device is offline
        print(f"== starting the edge agent on {edge_url}: smollm2-135m-q2_k, n_ctx 512, upstream {cloud_url}")
        edge_env = {**env, "CASCADE_EDGE_UPSTREAM_URL": cloud_url, "CASCADE_EDGE_UPSTREAM_API_KEY": key,
                    "CASCADE_EDGE_CASCADE_DEVICE": "kiosk-1", "CASCADE_EDGE_UPSTREAM_MAX_BACKOFF_S": "4",
                    "CASCADE_EDGE_SYNC_PATH": str(work / "queue.db"), **fleet.device_env}
        calibrated = Path(home) / "edge.toml"  # written by `cascade calibrate`, if it has run
        extra = ["--config", str(calibrated)] if calibrated.is_file() else []
        if not extra:  # an uncalibrated default: escalate when the first 8 tokens average below -1.2
            edge_env.update(CASCADE_EDGE_CASCADE_HOLD_TOKENS="8", CASCADE_EDGE_CASCADE_MIN_MEAN_LOGPROB="-1.2")
        print(f"   thresholds: {calibrated if extra else 'uncalibrated defaults (run cascade calibrate)'}")
        edge = spawn([*cli, "edge", "run", "--port", str(edge_port), "--model", "smollm2-135m-q2_k",
                      "--n-ctx", "512", *extra], env=edge_env, die_with_parent=True)
        wait_healthy(edge_url, edge, 900, "edge agent")
        queued = offline_scene(edge_url, work / "queue.db")
        wait_healthy(cloud_url, cloud, 900, "cloud tier")
        print(f"\n== the cloud tier is up on {cloud_url}: the queue drains")
        drain(edge_url, queued)
        rows = []
        for prompt, options in SCRIPT:
            first_line = prompt.splitlines()[0]
            print(f"\n-- app: {first_line[:70]}{' ...' if len(prompt) > 70 else ''}"
                  f"{'  ' + json.dumps(options) if options else ''}")
            r = stream_chat(edge_url, "smollm2-135m-q2_k", prompt, options)
            print(f"-- {r['tier']} ({r['reason']}{', degraded' if r['degraded'] else ''}): {r['text'][:160]}")
            rows.append((first_line, options, r))
        print(f"\n{'request':<46} {'answered by':<11} {'why':<18} {'TTFT ms':>8} {'total ms':>9} {'conf':>6}")
        for first_line, _, r in rows:
            conf = r["confidence"]["mean_logprob"] if r["confidence"] else float("nan")
            print(f"{first_line[:45]:<46} {r['tier'] or '-':<11} {r['reason'] or '-':<18} {r['ttft_ms']:>8.0f} "
                  f"{r['total_ms']:>9.0f} {conf:>6.2f}")
        fleet_scene(fleet, edge_url, home, work, "smollm2-135m-q2_k")
        from cascade_cli.demo_rollout import rollout_scene

        rollout_scene(fleet, edge_url, home, work, "smollm2-135m-q2_k")
        print("\nconf = mean logprob of the edge answer's first K tokens (auto mode holds them back and "
              "escalates below the threshold; TTFT includes that hold-back).")
        print("Try it: cascade cloud serve & cascade cloud keys create --tenant me; "
              "CASCADE_EDGE_UPSTREAM_URL=http://127.0.0.1:8000 CASCADE_EDGE_UPSTREAM_API_KEY=<key> cascade edge run")
        return 0
    finally:
        if edge is not None:
            stop(edge)
        stop(cloud)
        if fleet is not None:
            fleet.stop()
