"""Fleet rollout at scale: N simulated devices take one model version from `cascade fleet serve`
over a real Mosquitto, then the same downloads from the control plane alone and from a plain
static file server, same run.

    .venv/bin/python bench/fleet_rollout.py [--devices 1000] [--size-mb 4] [--procs P]
        [--downloads plane|public|mirror] [--json] [--dir DIR]

Setup (not timed in the rollout): TUF keys, one GGUF of --size-mb pushed and signed, N devices
enrolled with DeviceStore.add (a salted hash each), a local Mosquitto (the per-client queue of the one
`fleet serve` starts, otherwise default limits; no
persistence), `cascade fleet serve --broker` as a subprocess (its CPU read with psutil), and the
devices in --procs child processes (bench/fleet_sim.py: the real DeviceStateClient and
DeviceUpdater per device, one paho loop thread and one updater thread each). At most
PER_PROCESS devices a process, measured: paho's loop calls select(), which refuses a file
descriptor above 1023, and each paho client holds three (its socket and a wake-up socket
pair), so past ~340 clients in one process the later ones connect and drop, over and over
(threads are no problem). Then one `assign` of the version to the whole group, and the clock
runs until the control plane has stored ACTIVE with the right digest for every device, or
every device has reached a final state. Per device: assign -> signed document received -> TUF
metadata verified (DOWNLOADING) -> last byte (VERIFYING) -> sha256 checked against the signed
target (ACTIVATING) -> ACTIVE.

Where devices fetch from (--downloads): ``plane`` the control plane, each device's credentials
checked (the default of `cascade fleet serve`); ``public`` the control plane with ``[server]
public_downloads = true`` (no credential check); ``mirror`` the static server below, for
metadata and artifacts (the control plane only does MQTT).

The download rows: every device runs download.fetch (the code the updater runs: a fresh GET,
no Range since nothing is partial, fsync, sha256) at once, from the control plane's
/v1/artifacts and then from Starlette StaticFiles on uvicorn (bench/fleet_static.py), same URL
shape. Device state lives under --dir (default: a temporary folder on the disk; on tmpfs a
device's fsync costs nothing). Goal (issue 13): 1,000 devices ACTIVE in under 60 s on this
machine, which here also runs the devices: the device processes' CPU is shown beside the
control plane's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import getpass
import json
import multiprocessing as mp
import os
import shutil
import socket
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import psutil

# run as `.venv/bin/python bench/fleet_rollout.py`: sys.path[0] is bench/, so its sibling module
# imports by its bare name
from fleet_sim import Timeline, serve

from cascade.processes import free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command
from model_distribution.artifacts.download import fetch
from model_distribution.control_plane.broker import MAX_QUEUED
from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Manifest, Registry
from model_distribution.registry.tuf_client import verified_target

REPO = Path(__file__).resolve().parent.parent
GOAL_S = 60.0
GROUP = "fleet"
PER_PROCESS = 200  # paho clients a device process (3 fds each, beside the downloads' sockets and files; < 1024)


@dataclass
class Fleet:
    work: Path
    repo: Repository
    store: DeviceStore
    manifest: Manifest
    devices: list[tuple[str, str]]  # (device id, secret)
    enrol_s: float


def make_fleet(work: Path, n: int, size: int) -> Fleet:
    """Keys, one GGUF of about ``size`` bytes (random float32 weights) pushed and signed, ``n``
    devices enrolled in one group."""
    root = work / "control" / "fleet"
    repo = Repository(root)
    repo.init()
    m = make_version(repo, work, "1.0.0", size)
    store = DeviceStore(root)
    start = time.perf_counter()
    devices = [(name, store.add(name, [GROUP])) for name in (f"dev-{i:05d}" for i in range(n))]
    return Fleet(work, repo, store, m, devices, time.perf_counter() - start)


def make_version(repo: Repository, work: Path, version: str, size: int, seed: int = 0) -> Manifest:
    """bench@``version``: a GGUF of about ``size`` bytes (random float32 weights from ``seed``: another
    seed, other bytes) pushed and signed. Before the control plane starts: it signs the metadata too."""
    path = work / f"model-{version}.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(256)
    w.add_file_type(0)
    w.add_tensor("t", np.random.default_rng(seed).standard_normal(max(size // 4 - 256, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    reg = Registry(repo.root)
    m, _ = reg.push(path, "bench", version)
    reg.close()
    repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
    return m


@dataclass
class Servers:
    broker: object  # subprocess.Popen
    broker_url: str
    plane: object
    plane_url: str
    static: object
    static_url: str


@contextlib.contextmanager
def servers(fleet: Fleet, public_downloads: bool, env: dict[str, str] | None = None):
    """Mosquitto, `cascade fleet serve --broker` (``env``: more of its settings) and the static
    server, each a process of its own."""
    work = fleet.work
    binary = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin:/usr/local/sbin")
    if binary is None:
        sys.exit("bench/fleet_rollout.py: needs mosquitto (apt-get install mosquitto)")
    mqtt_port, port, static_port = free_port(), free_port(), free_port()
    conf = work / "mosquitto.conf"
    conf.write_text(f"listener {mqtt_port} 127.0.0.1\nallow_anonymous true\npersistence false\n"
                    f"max_queued_messages {MAX_QUEUED}\n"  # as the broker `fleet serve` starts has
                    f"log_dest file {work / 'mosquitto.log'}\nlog_type error\nlog_type warning\nlog_type notice\n"
                    f"user {getpass.getuser()}\n")  # as root it would drop to "mosquitto", who cannot write here
    procs = [spawn([binary, "-c", str(conf)], log=work / "mosquitto.out")]
    try:
        s = Servers(procs[0], f"mqtt://127.0.0.1:{mqtt_port}", None, f"http://127.0.0.1:{port}", None,
                    f"http://127.0.0.1:{static_port}")
        env = {**(env or {}), "CASCADE_HOME": str(work / "control")}
        if public_downloads:
            env["CASCADE_FLEET_SERVER_PUBLIC_DOWNLOADS"] = "true"
        s.plane = spawn(cascade_command("fleet", "serve", "--port", str(port), "--broker", s.broker_url), env=env,
                        log=work / "fleet-serve.log", cwd=REPO)
        procs.append(s.plane)
        s.static = spawn([sys.executable, "-m", "uvicorn", "fleet_static:app", "--app-dir", str(REPO / "bench"),
                          "--host", "127.0.0.1", "--port", str(static_port), "--log-level", "warning"],
                         env={"FLEET_STATIC_ARTIFACTS": str(fleet.repo.root / "artifacts" / "sha256"),
                              "FLEET_STATIC_TUF": str(fleet.repo.metadata_dir)}, log=work / "static.log", cwd=REPO)
        procs.append(s.static)
        _wait_port(mqtt_port, s.broker)
        wait_healthy(s.plane_url, s.plane, 60, "cascade fleet serve", log=work / "fleet-serve.log")
        wait_healthy(s.static_url, s.static, 60, "static server", path=f"/v1/artifacts/{fleet.manifest.sha256}",
                     log=work / "static.log")
        yield s
    finally:
        for p in reversed(procs):
            stop(p)


def _wait_port(port: int, proc, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            return
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise
            time.sleep(0.05)


def cpu_s(*pids: int) -> float:
    """User + system CPU seconds of these processes so far."""
    total = 0.0
    for pid in pids:
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def thread_cpu_s(pid: int) -> dict[int, float]:
    return {t.id: t.user_time + t.system_time for t in psutil.Process(pid).threads()}


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def probe(fleet: Fleet, plane_url: str, work: Path, n: int = 10) -> dict:
    """One device's requests alone, one after the other: a cold TUF refresh and one artifact
    fetch, wall and this process's CPU (ms, medians: the first refresh carries the check
    of the credentials, which the median leaves out); and one check of a device secret."""
    m, auth = fleet.manifest, fleet.devices[0]
    rows: dict[str, list[float]] = {"tuf_refresh_ms": [], "tuf_refresh_cpu_ms": [], "artifact_fetch_ms": [],
                                    "artifact_fetch_cpu_ms": []}
    for i in range(n):
        wall, cpu = time.perf_counter(), time.process_time()
        info = verified_target(work / f"probe-{i}", f"{plane_url}/v1/tuf/", fleet.repo.root_bytes(), m.name,
                               m.version, auth)
        rows["tuf_refresh_ms"].append((time.perf_counter() - wall) * 1e3)
        rows["tuf_refresh_cpu_ms"].append((time.process_time() - cpu) * 1e3)
        wall, cpu = time.perf_counter(), time.process_time()
        fetch(f"{plane_url}/v1/artifacts/{m.sha256}", work / f"probe-{i}" / "artifact", info, auth=auth)
        rows["artifact_fetch_ms"].append((time.perf_counter() - wall) * 1e3)
        rows["artifact_fetch_cpu_ms"].append((time.process_time() - cpu) * 1e3)
        shutil.rmtree(work / f"probe-{i}")
    out = {k: float(np.median(v)) for k, v in rows.items()}
    cpu = time.process_time()
    fleet.store.authenticate(*auth)
    out["secret_check_ms"] = (time.process_time() - cpu) * 1e3
    return out


def start_devices(fleet: Fleet, s: Servers, procs: int, mirror: bool) -> list:
    """The devices in ``procs`` child processes (spawned: no fork of a process with threads),
    once every one of them is connected to the broker: [(process, pipe)]."""
    ctx = mp.get_context("spawn")
    per = -(-len(fleet.devices) // procs)
    children = []
    for i in range(0, len(fleet.devices), per):
        ours, theirs = ctx.Pipe()
        p = ctx.Process(target=serve, daemon=True, args=(
            theirs, fleet.devices[i:i + per], s.broker_url, s.plane_url, fleet.repo.root_bytes(),
            fleet.repo.desired_public_key(), str(fleet.work / "devices"), fleet.manifest.sha256,
            fleet.manifest.size, s.static_url if mirror else "", str(fleet.work / f"devices-{len(children)}.log")))
        p.start()
        children.append((p, ours))
    for _, conn in children:
        if not conn.poll(300):
            raise RuntimeError("the devices did not connect to the broker in 300 s")
        conn.recv()
    return children


def rollout(fleet: Fleet, s: Servers, children: list, timeout_s: float) -> dict:
    """Assign the version to the group; time until the control plane stored ACTIVE for all."""
    m, n = fleet.manifest, len(fleet.devices)
    device_pids = [p.pid for p, _ in children]
    cpu0 = {"control plane": cpu_s(s.plane.pid), "mosquitto": cpu_s(s.broker.pid),
            "devices (simulated)": cpu_s(*device_pids), "bench (polls the store)": cpu_s(os.getpid())}
    threads0 = thread_cpu_s(s.plane.pid)
    t0 = time.time()
    fleet.store.assign(m, group=GROUP)
    stored_s, all_final_at = None, None
    timelines: list[Timeline] = []
    waiting = [conn for _, conn in children]  # each sends its timelines once all its devices are final
    while time.time() - t0 < timeout_s:
        active = sum(1 for d in fleet.store.list(group=GROUP) if (d.reported or {}).get("state") == "ACTIVE"
                     and d.reported.get("sha256") == m.sha256 and d.reported.get("rev") == d.desired_rev)
        if active == n:
            stored_s = time.time() - t0
            break
        for conn in [c for c in waiting if c.poll()]:
            timelines += conn.recv()[1]
            waiting.remove(conn)
        all_final_at = all_final_at or (None if waiting else time.time())
        if all_final_at and time.time() - all_final_at > 10:  # every device is done and not all are ACTIVE
            break
        time.sleep(0.2)
    wall = time.time() - t0
    cpu = {"control plane": cpu_s(s.plane.pid), "mosquitto": cpu_s(s.broker.pid),
           "devices (simulated)": cpu_s(*device_pids), "bench (polls the store)": cpu_s(os.getpid())}
    threads = thread_cpu_s(s.plane.pid)
    all_final = stored_s is not None or not waiting  # else it timed out with devices still busy
    for conn in waiting:
        if stored_s is None:
            conn.send(("enough",))  # stop waiting: the devices send what they have
        timelines += conn.recv()[1]
    main_s = threads.get(s.plane.pid, 0.0) - threads0.get(s.plane.pid, 0.0)
    busy = sorted((t - threads0.get(tid, 0.0) for tid, t in threads.items() if tid != s.plane.pid), reverse=True)
    ok = [t for t in timelines if t.final == "ACTIVE"]
    span = (max(t.verifying for t in ok) - min(t.downloading for t in ok)) if ok else float("nan")
    return {"wall_s": wall, "stored_all_active_s": stored_s, "stored_active": active,
            "cpu_s": {k: cpu[k] - cpu0[k] for k in cpu},
            "plane_main_thread_s": main_s, "plane_other_threads_s": sum(busy),
            "plane_busy_threads": sum(1 for b in busy if b >= 0.1),
            "finals": {f: sum(1 for t in timelines if t.final == f) for f in sorted({t.final for t in timelines})},
            "retries": sum(t.retries for t in timelines),
            "all_final": all_final,
            "reasons": collections.Counter(repr(t.reason) for t in timelines if t.final != "ACTIVE").most_common(5),
            "download_mb_s": len(ok) * m.size / 1e6 / span if ok else 0.0,
            "phases": {"signed document received": [t.desired - t0 for t in ok],
                       "TUF metadata verified": [t.downloading - t.desired for t in ok],
                       "download (last byte)": [t.verifying - t.downloading for t in ok],
                       "sha256 vs signed target": [t.activating - t.verifying for t in ok],
                       "activate (sha256 check)": [t.active - t.activating for t in ok],
                       "ACTIVE at the device": [t.active - t0 for t in ok]}}


def stop_devices(children: list) -> None:
    for _, conn in children:
        conn.send(("stop",))
    for p, conn in children:
        if conn.poll(30):
            conn.recv()
        p.join(timeout=10)


def downloads(fleet: Fleet, children: list, url: str, server_pid: int) -> dict:
    """Every device downloads the artifact from ``url`` at once."""
    device_pids = [p.pid for p, _ in children]
    server0, devices0 = cpu_s(server_pid), cpu_s(*device_pids)
    for _, conn in children:
        conn.send(("download", f"{url}/v1/artifacts/{fleet.manifest.sha256}", "baseline"))
    got = []
    for _, conn in children:
        got += conn.recv()[1]
    good = [g for g in got if not g[2]]
    span = max(g[1] for g in got) - min(g[0] for g in got)
    server = cpu_s(server_pid) - server0
    return {"wall_s": span, "ok": len(good), "errors": sorted({g[2] for g in got if g[2]})[:3],
            "mb_s": len(good) * fleet.manifest.size / 1e6 / span, "per_download_s": [g[1] - g[0] for g in good],
            "server_cpu_s": server, "mb_per_server_cpu_s": len(good) * fleet.manifest.size / 1e6 / max(server, 1e-9),
            "devices_cpu_s": cpu_s(*device_pids) - devices0}


def run(args, work: Path, say) -> dict:
    fleet = make_fleet(work, args.devices, int(args.size_mb * 1e6))
    n = len(fleet.devices)
    say(f"setup: {n} devices enrolled in {fleet.enrol_s:.1f} s ({fleet.enrol_s / n * 1e3:.0f} ms each: "
        f"DeviceStore.add hashes the secret), artifact {fleet.manifest.size / 1e6:.1f} MB")
    children: list = []
    try:
        with servers(fleet, args.downloads == "public") as s:
            alone = probe(fleet, s.plane_url, work)
            start = time.perf_counter()
            children = start_devices(fleet, s, args.procs, args.downloads == "mirror")
            connect_s = time.perf_counter() - start
            say(f"{n} devices connected in {connect_s:.1f} s ({len(children)} processes); rolling out")
            result = rollout(fleet, s, children, args.timeout)
            rows = {}
            if result["all_final"]:  # else devices may still be busy: no fair rows
                say("rolled out; the same downloads from each server")
                rows = {"cascade fleet serve": downloads(fleet, children, s.plane_url, s.plane.pid),
                        "Starlette StaticFiles": downloads(fleet, children, s.static_url, s.static.pid)}
            stop_devices(children)
    finally:
        for p, _ in children:
            if p.is_alive():
                p.kill()
        fleet.store.close()
    broker_log = work / "mosquitto.log"
    dropped = [ln for ln in (broker_log.read_text(errors="replace").splitlines() if broker_log.exists() else [])
               if "dropp" in ln]
    plane_log = (work / "fleet-serve.log").read_text(errors="replace").splitlines()
    return {"devices": n, "procs": len(children), "downloads_from": args.downloads, "size_bytes": fleet.manifest.size,
            "enrol_s": fleet.enrol_s, "connect_s": connect_s, "probe": alone, "rollout": result, "downloads": rows,
            "broker_dropped_lines": len(dropped), "broker_dropped_sample": dropped[:3],
            "plane_log_errors": sum(1 for ln in plane_log if "ERROR" in ln or "Traceback" in ln),
            "cores": os.cpu_count(), "goal_s": GOAL_S}


def print_tables(r: dict) -> None:
    n, size_mb, ro = r["devices"], r["size_bytes"] / 1e6, r["rollout"]
    where = {"plane": "the control plane, credentials checked", "public": "the control plane, public_downloads",
             "mirror": "a static mirror"}[r["downloads_from"]]
    print(f"\nRollout of one {size_mb:.1f} MB version to {n} devices ({r['procs']} device processes, "
          f"{r['cores']} cores shared by all; metadata and artifacts from {where})")
    stored = ro["stored_all_active_s"]
    reached = f"NOT reached ({ro['stored_active']} of {n})" if stored is None else f"{stored:.1f} s"
    print(f"  assign -> the control plane stored ACTIVE for every device: {reached} (waited {ro['wall_s']:.1f} s); "
          f"final states at the devices: {ro['finals']}, cut downloads tried again: {ro['retries']}")
    for reason, count in ro["reasons"]:
        print(f"    {count} x reason {reason}")
    print(f"\n{'per device (s)':28s} {'p50':>7s} {'p95':>7s} {'max':>7s}")
    for name, values in ro["phases"].items():
        print(f"{name:28s} {pct(values, 50):7.2f} {pct(values, 95):7.2f} {max(values, default=float('nan')):7.2f}")
    wall = ro["wall_s"]
    print(f"\n{'CPU during the rollout':28s} {'s':>7s} {'% of 1 core':>12s} {'ms/device':>10s}")
    for name, sec in ro["cpu_s"].items():
        print(f"{name:28s} {sec:7.1f} {sec / wall * 100:11.0f}% {sec / n * 1e3:10.1f}")
    print(f"  control plane: main thread (the HTTP event loop) {ro['plane_main_thread_s']:.1f} s, other threads "
          f"{ro['plane_other_threads_s']:.1f} s ({ro['plane_busy_threads']} busy: credential checks on "
          "asyncio.to_thread, file reads, paho storing reports, the publisher)")
    print(f"  artifact MB/s during the rollout (first download start -> last byte): {ro['download_mb_s']:.0f}")
    p = r["probe"]
    print(f"  one device alone: cold TUF refresh {p['tuf_refresh_ms']:.0f} ms ({p['tuf_refresh_cpu_ms']:.0f} ms of "
          f"its CPU), artifact fetch {p['artifact_fetch_ms']:.0f} ms ({p['artifact_fetch_cpu_ms']:.0f} ms CPU); "
          f"one check of a device secret {p['secret_check_ms']:.0f} ms CPU (x {n} = "
          f"{p['secret_check_ms'] * n / 1e3:.0f} s)")
    if r["downloads"]:
        print(f"\nThe same downloads, all {n} devices at once (download.fetch: GET, fsync, sha256)")
        print(f"{'server':24s} {'MB/s':>7s} {'wall s':>7s} {'p50 s':>7s} {'p95 s':>7s} {'server CPU s':>13s} "
              f"{'MB/server CPU-s':>16s} {'devices CPU s':>14s} {'ok':>6s}")
        for label, d in r["downloads"].items():
            print(f"{label:24s} {d['mb_s']:7.0f} {d['wall_s']:7.1f} {pct(d['per_download_s'], 50):7.2f} "
                  f"{pct(d['per_download_s'], 95):7.2f} {d['server_cpu_s']:13.1f} {d['mb_per_server_cpu_s']:16.0f} "
                  f"{d['devices_cpu_s']:14.1f} {d['ok']:6d}")
            for e in d["errors"]:
                print(f"    error: {e}")
    print(f"\nbroker: {r['broker_dropped_lines']} 'dropped' line(s) in its log; control plane log: "
          f"{r['plane_log_errors']} error line(s)")
    for line in r["broker_dropped_sample"]:
        print(f"    {line}")
    verdict = "met" if stored is not None and stored < r["goal_s"] else "NOT met"
    print(f"goal: {n} devices ACTIVE in < {r['goal_s']:.0f} s: {verdict}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--size-mb", type=float, default=4.0)
    ap.add_argument("--procs", type=int, help=f"child processes the devices are spread over (default: "
                    f"{PER_PROCESS} devices each, at least 2)")
    ap.add_argument("--downloads", choices=("plane", "public", "mirror"), default="plane",
                    help="where devices fetch metadata and artifacts (see above; default: plane)")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up on the rollout after this many seconds")
    ap.add_argument("--dir", help="where the control plane's and the devices' state go (default: a temporary folder)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args()
    args.procs = args.procs or max(2, -(-args.devices // PER_PROCESS))
    if args.devices < 1 or args.size_mb <= 0 or args.timeout <= 0:
        ap.error("--devices must be >= 1, --size-mb and --timeout > 0")
    if args.procs < 1 or -(-args.devices // args.procs) > 300:
        ap.error(f"--procs {args.procs}: at most 300 devices a process (paho's select() loop), at least 1 process")
    work = Path(tempfile.mkdtemp(prefix="fleet-rollout-", dir=args.dir))
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    try:
        result = run(args, work, say)
    finally:
        shutil.rmtree(work / "devices", ignore_errors=True)  # gigabytes; the logs stay
        say(f"logs in {work}")
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
