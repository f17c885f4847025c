"""A staged rollout at scale (issue 14): N simulated devices on version 1, then a rollout of
version 2 in waves, run by the RolloutController inside `cascade fleet serve`, over a real
Mosquitto.

    .venv/bin/python bench/fleet_waves.py [--devices 1000] [--size-mb 1] [--waves 1,10,50,100]
        [--bake 0] [--gate G ...] [--prefetch | --no-prefetch] [--tick 0.5] [--plot PATH] [--json]

The fleet, servers and devices are bench/fleet_rollout.py's (its docstring says how; both
versions are pushed and signed before the control plane starts). A rollout needs every device
to have a version to go back to, so version 1 is assigned to the group first and the clock
waits until every device is ACTIVE on it (at the device: the rollout follows the reports of its
own revisions, so a version-1 report the broker dropped on its way to the control plane does not
matter; the table counts Mosquitto's "dropped" lines in each phase). Then the rollout starts the way `cascade fleet
rollout start bench@2.0.0 --group fleet --waves ... --bake ...` starts it on the local state
(rollout_commands.start), and every SAMPLE_S this process reads the executions by wave and state
from the registry's database (a read of its own: /metrics would be served by, and cost, the
control plane being measured) and the CPU of each process, until the rollout is no longer
RUNNING or --timeout.

Per wave: opened = the rollout started (wave 1) or the controller passed the wave before (its
decision's time); done = the last of the wave's executions moved to a final state (the
execution's own timestamp, the controller's clock). Each wave's time includes up to two of the
controller's ticks (--tick: it sees the wave done, then judges it; the next wave's devices are
assigned on the tick after that). The simulated devices send no telemetry, so a serving --gate
has no value to judge and the rollout pauses as inconclusive after wave 1 (the run stops there;
only the install failure gate, --max-failure-rate, has numbers here).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import psutil

# run as `.venv/bin/python bench/fleet_waves.py`: sys.path[0] is bench/
from fleet_rollout import (
    GROUP,
    PER_PROCESS,
    cpu_s,
    make_fleet,
    make_version,
    pct,
    rollout,
    servers,
    start_devices,
    stop_devices,
)

from model_distribution.registry.store import Registry
from model_distribution.rollout import commands as rollout_commands
from model_distribution.rollout.spec import RolloutError, RolloutSpec
from model_distribution.rollout.states import FAILURES, RolloutState
from model_distribution.rollout.store import RolloutStore

GOAL_S = 60.0
SAMPLE_S = 0.5
STATES = ("SUCCEEDED", "IN_PROGRESS", "QUEUED", "FAILED", "TIMED_OUT", "REJECTED", "CANCELED", "ROLLED_BACK")
COLOURS = ("#2ca02c", "#1f77b4", "#c7c7c7", "#d62728", "#ff7f0e", "#9467bd", "#7f7f7f", "#8c564b")


def watch(fleet, s, children, spec: RolloutSpec, sha256: str, timeout_s: float) -> dict:
    """Start the rollout and sample it every SAMPLE_S until it is not RUNNING (or ``timeout_s``);
    then the devices' timelines of the change to ``sha256``."""
    for _, conn in children:
        conn.send(("follow", sha256))
    for _, conn in children:
        conn.recv()
    root = fleet.repo.root
    registry, rollouts = Registry(root), RolloutStore(root)
    pids = {"control plane": [s.plane.pid], "mosquitto": [s.broker.pid],
            "devices (simulated)": [p.pid for p, _ in children], "bench (samples the store)": [os.getpid()]}
    samples = []  # {"t", "states": {state: n}, "waves": {wave: {state: n}}, "wave", "state", "cpu": {name: s}}
    try:
        cpu0, busy0 = {k: cpu_s(*v) for k, v in pids.items()}, machine_busy_s()
        began = time.time()
        r = rollout_commands.start(registry, fleet.store, rollouts, spec)
        start_s = time.time() - began
        t0 = r.created_at  # the executions' and decisions' times are on this (the controller's) clock
        while True:
            execs = rollouts.executions(r.rollout_id)
            r = rollouts.get(r.rollout_id)
            now = time.time()
            by_wave: dict[int, collections.Counter] = collections.defaultdict(collections.Counter)
            for e in execs:
                by_wave[e.wave][e.state] += 1
            samples.append({"t": now - t0, "states": dict(collections.Counter(e.state for e in execs)),
                            "waves": {w: dict(c) for w, c in by_wave.items()}, "wave": r.wave, "state": r.state,
                            "cpu": {k: cpu_s(*v) - cpu0[k] for k, v in pids.items()}})
            if r.state != RolloutState.RUNNING or now - t0 > timeout_s:
                break
            time.sleep(max(0.0, SAMPLE_S - (time.time() - now)))
        decisions = rollouts.decisions(r.rollout_id)
        timelines = {}
        for _, conn in children:
            conn.send(("timelines",))
        for _, conn in children:
            timelines.update((t.device, t) for t in conn.recv()[1])
    finally:
        registry.close()
        rollouts.close()
    n = len(execs)
    all_succeeded = bool(execs) and all(e.state == "SUCCEEDED" for e in execs)
    passed = {d["wave"]: d["at"] for d in decisions if d["outcome"] == "pass"}
    waves = []
    for k, share in enumerate(spec.waves):
        mine = [e for e in execs if e.wave == k]
        opened = t0 if k == 0 else passed.get(k - 1)
        finished = mine and all(e.state not in ("QUEUED", "IN_PROGRESS") for e in mine)
        done = max(e.updated_at for e in mine) - t0 if finished else None
        ok = [(e, timelines[e.device_id]) for e in mine if e.state == "SUCCEEDED" and e.device_id in timelines
              and timelines[e.device_id].active]
        waves.append({"wave": k + 1, "share": share, "devices": len(mine),
                      "succeeded": sum(1 for e in mine if e.state == "SUCCEEDED"),
                      "failed": sum(1 for e in mine if e.state in FAILURES),
                      "downloaded": sum(1 for _, t in ok if t.downloading),  # the rest had it from a prefetch
                      "opened_s": None if opened is None else opened - t0, "done_s": done,
                      "judged_s": passed[k] - t0 if k in passed else None,
                      "phases": {} if opened is None else {
                          "wave opened -> document": [t.desired - opened for _, t in ok if t.desired],
                          "document -> ACTIVATING": [t.activating - t.desired for _, t in ok if t.desired],
                          "ACTIVATING -> ACTIVE": [t.active - t.activating for _, t in ok if t.activating],
                          "ACTIVE -> SUCCEEDED stored": [e.updated_at - t.active for e, t in ok]}})
    gaps = [b["t"] - a["t"] for a, b in zip(samples, samples[1:], strict=False)]
    return {"rollout": r.rollout_id, "state": r.state, "reason": r.reason, "devices": n, "start_call_s": start_s,
            "max_sample_gap_s": max(gaps, default=0.0),
            "others_cpu_s": machine_busy_s() - busy0 - sum(samples[-1]["cpu"].values()),
            "all_succeeded_s": max(e.updated_at for e in execs) - t0 if all_succeeded else None,
            "rollout_done_s": r.updated_at - t0 if r.state != RolloutState.RUNNING else None,
            "final": dict(collections.Counter(e.state for e in execs)),
            "reasons": collections.Counter(e.detail for e in execs if e.state in FAILURES).most_common(5),
            "waves": waves, "samples": samples}


def machine_busy_s() -> float:
    """CPU seconds every core of this machine has been busy (not idle or waiting for I/O)."""
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def cpu_rows(samples: list[dict]) -> dict[str, dict]:
    """Per process: CPU seconds in all, mean % of one core, and the peak % over 1 s windows (the
    samples 1 s or more apart nearest to each other)."""
    out = {}
    wall = samples[-1]["t"] - samples[0]["t"] if len(samples) > 1 else float("nan")
    for name in samples[0]["cpu"]:
        total = samples[-1]["cpu"][name]
        windows, j = [], 0
        for i, a in enumerate(samples):
            j = max(j, i + 1)
            while j < len(samples) and samples[j]["t"] - a["t"] < 1.0 - 1e-3:
                j += 1
            if j == len(samples):
                break
            b = samples[j]
            windows.append((b["cpu"][name] - a["cpu"][name]) / (b["t"] - a["t"]) * 100)
        out[name] = {"cpu_s": total, "mean_pct": total / wall * 100 if wall > 0 else float("nan"),
                     "peak_pct": max(windows, default=float("nan"))}
    return out


def plot(result: dict, path: Path, title: str) -> None:
    """Devices by execution state over time (stacked), wave openings marked; below, the control
    plane's CPU over 1 s windows."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result["samples"]
    t = [x["t"] for x in samples]
    seen = [(st, c) for st, c in zip(STATES, COLOURS, strict=True) if any(x["states"].get(st) for x in samples)]
    fig, (ax, cpu) = plt.subplots(2, 1, sharex=True, figsize=(10, 6.5), height_ratios=(3, 1))
    ax.stackplot(t, [[x["states"].get(st, 0) for x in samples] for st, _ in seen], labels=[st for st, _ in seen],
                 colors=[c for _, c in seen], step="post")
    for w in result["waves"]:
        if w["opened_s"] is not None:
            for a in (ax, cpu):
                a.axvline(w["opened_s"], color="black", linestyle="--", linewidth=0.8)
            ax.text(w["opened_s"], result["devices"] * 1.01, f" wave {w['wave']} ({w['share']}%)", fontsize=8,
                    va="bottom")
    ax.set_ylabel("devices")
    ax.set_ylim(0, result["devices"] * 1.08)
    ax.set_title(title, fontsize=10)
    ax.legend(loc="center right", fontsize=8)
    mid, pct = [], []
    for a, b in zip(samples, samples[2:], strict=False):  # SAMPLE_S 0.5: two apart is about 1 s
        mid.append((a["t"] + b["t"]) / 2)
        pct.append((b["cpu"]["control plane"] - a["cpu"]["control plane"]) / (b["t"] - a["t"]) * 100)
    cpu.plot(mid, pct, color="black", linewidth=1)
    cpu.set_ylabel("control plane\nCPU % (1 s)")
    cpu.set_xlabel("seconds since the rollout started")
    cpu.set_ylim(bottom=0)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args, spec: RolloutSpec, work: Path, say) -> dict:
    size = int(args.size_mb * 1e6)
    fleet = make_fleet(work, args.devices, size)
    target = make_version(fleet.repo, work, spec.model.partition("@")[2], size, seed=1)
    n = len(fleet.devices)
    say(f"setup: {n} devices enrolled in {fleet.enrol_s:.1f} s, two versions of {size / 1e6:.1f} MB")
    children: list = []
    try:
        env = {"CASCADE_FLEET_SERVER_ROLLOUT_TICK_S": str(args.tick)}
        with servers(fleet, args.downloads == "public", env) as s:
            children = start_devices(fleet, s, args.procs, args.downloads == "mirror")
            say(f"{n} devices connected ({len(children)} processes); version 1 to all of them")
            first = rollout(fleet, s, children, args.timeout)
            if first["finals"] != {"ACTIVE": n}:
                raise RuntimeError(f"version 1 did not reach every device: {first['finals']}, {first['reasons']} "
                                   f"(logs in {work})")
            # the rollout follows reports of its own revisions: v1 reports the broker dropped do not matter
            v1_s, drops_v1 = max(first["phases"]["ACTIVE at the device"]), len(broker_drops(work))
            say(f"version 1 ACTIVE at every device in {v1_s:.1f} s (the control plane stored it for "
                f"{first['stored_active']}); rolling out {spec.model} in waves {','.join(map(str, spec.waves))}")
            result = watch(fleet, s, children, spec, target.sha256, args.timeout)
            stop_devices(children)
    finally:
        for p, _ in children:
            if p.is_alive():
                p.kill()
        fleet.store.close()
    plane_log = (work / "fleet-serve.log").read_text(errors="replace").splitlines()
    return {**result, "procs": len(children), "size_bytes": size, "spec": asdict(spec),
            "version1_active_s": v1_s, "version1_stored": first["stored_active"],
            "broker_drops": [drops_v1, len(broker_drops(work)) - drops_v1], "cpu": cpu_rows(result["samples"]),
            "plane_log_errors": sum(1 for ln in plane_log if "ERROR" in ln or "Traceback" in ln),
            "downloads_from": args.downloads, "tick_s": args.tick, "cores": os.cpu_count(), "goal_s": GOAL_S}


def broker_drops(work: Path) -> list[str]:
    """Mosquitto's lines saying it dropped messages to a client (its max_queued_messages, default 1000)."""
    log = work / "mosquitto.log"
    return [ln for ln in log.read_text(errors="replace").splitlines() if "dropp" in ln] if log.exists() else []


def title(r: dict) -> str:
    spec = r["spec"]
    return (f"{r['devices']} devices, {spec['model']} ({r['size_bytes'] / 1e6:.1f} MB), waves "
            f"{','.join(map(str, spec['waves']))}, bake {spec['bake_s']:g} s, prefetch "
            f"{'on' if spec['prefetch'] else 'off'}, tick {r['tick_s']:g} s")


def print_tables(r: dict) -> None:
    print(f"\nStaged rollout: {title(r)} ({r['procs']} device processes, {r['cores']} cores shared by all)")
    print(f"  first, version 1 to every device (one assign): ACTIVE at every device in {r['version1_active_s']:.1f} s, "
          f"the control plane stored it for {r['version1_stored']} of {r['devices']}; broker 'dropped' lines: "
          f"{r['broker_drops'][0]} then, {r['broker_drops'][1]} during the rollout")
    done, ended = r["all_succeeded_s"], r["rollout_done_s"]
    reached = f"{done:.1f} s" if done is not None else f"NOT reached: {r['final']}"
    at = "" if ended is None else f" at {ended:.1f} s"
    why = f" ({r['reason']})" if r["reason"] else ""
    print(f"  start -> 100% SUCCEEDED: {reached}; the rollout {r['state']}{at}{why} "
          f"(starting it took {r['start_call_s'] * 1e3:.0f} ms)")
    for reason, count in r["reasons"]:
        print(f"    {count} x {reason}")
    print(f"\n{'wave':>4s} {'share':>6s} {'devices':>8s} {'opened s':>9s} {'done s':>7s} {'took s':>7s} "
          f"{'succeeded':>10s} {'failed':>7s}")
    for w in r["waves"]:
        opened, end = w["opened_s"], w["done_s"]
        took = f"{end - opened:7.1f}" if opened is not None and end is not None else f"{'-':>7s}"
        opened_s = "-" if opened is None else f"{opened:.1f}"
        end_s = "-" if end is None else f"{end:.1f}"
        print(f"{w['wave']:4d} {w['share']:5d}% {w['devices']:8d} {opened_s:>9s} {end_s:>7s} {took} "
              f"{w['succeeded']:10d} {w['failed']:7d}")
    print("\nper device, p50 / p95 s (document -> ACTIVATING: the TUF refresh, and the download unless prefetched)")
    names = list(r["waves"][0]["phases"])
    print(f"{'wave':>4s} {'downloaded':>10s} " + " ".join(f"{name:>27s}" for name in names))
    for w in r["waves"]:
        cells = [f"{pct(w['phases'].get(name, []), 50):.2f} / {pct(w['phases'].get(name, []), 95):.2f}"
                 for name in names]
        print(f"{w['wave']:4d} {w['downloaded']:10d} " + " ".join(f"{c:>27s}" for c in cells))
    print(f"\n{'CPU during the rollout':28s} {'s':>7s} {'mean % of 1 core':>17s} {'peak % (1 s)':>13s}")
    for name, c in r["cpu"].items():
        print(f"{name:28s} {c['cpu_s']:7.1f} {c['mean_pct']:16.0f}% {c['peak_pct']:12.0f}%")
    wall = r["samples"][-1]["t"] - r["samples"][0]["t"]
    print(f"{'others on this machine':28s} {r['others_cpu_s']:7.1f} {r['others_cpu_s'] / wall * 100:16.0f}%"
          f"{'':>14s}(it is shared)")
    print(f"\nsamples every {SAMPLE_S} s, the longest gap {r['max_sample_gap_s']:.1f} s")
    print(f"control plane log: {r['plane_log_errors']} error line(s); plot: {r['plot']}")
    verdict = "met" if done is not None and done < r["goal_s"] else "NOT met"
    print(f"goal: {r['devices']} devices 100% SUCCEEDED in < {r['goal_s']:.0f} s: {verdict}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=1000)
    ap.add_argument("--size-mb", type=float, default=1.0)
    ap.add_argument("--waves", default="1,10,50,100", help="cumulative percentages of the group (default 1,10,50,100)")
    ap.add_argument("--bake", default="0", help="how long each wave bakes before its gates (default 0)")
    ap.add_argument("--gate", action="append", default=[], help="a serving gate, e.g. error_rate<=0.01 (repeatable)")
    ap.add_argument("--max-failure-rate", type=float, default=0.0)
    ap.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=True,
                    help="later waves download and verify ahead (default: on)")
    ap.add_argument("--tick", type=float, default=0.5, help="the control plane's [server] rollout_tick_s (default 0.5)")
    ap.add_argument("--procs", type=int, help=f"device processes (default: {PER_PROCESS} devices each, at least 2)")
    ap.add_argument("--downloads", choices=("plane", "public", "mirror"), default="plane",
                    help="where devices fetch metadata and artifacts (bench/fleet_rollout.py; default: plane)")
    ap.add_argument("--timeout", type=float, default=600.0, help="give up on each step after this many seconds")
    ap.add_argument("--dir", help="where the state and logs go (default: a temporary folder)")
    ap.add_argument("--plot", help="the PNG of devices by state over time (default: bench-fleet-waves.png in the "
                    "run's folder)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args()
    args.procs = args.procs or max(2, -(-args.devices // PER_PROCESS))
    if args.devices < 1 or args.size_mb <= 0 or args.timeout <= 0 or args.tick <= 0:
        ap.error("--devices must be >= 1, --size-mb, --timeout and --tick > 0")
    if args.procs < 1 or -(-args.devices // args.procs) > 300:
        ap.error(f"--procs {args.procs}: at most 300 devices a process (paho's select() loop), at least 1 process")
    try:
        spec = RolloutSpec("bench@2.0.0", GROUP, args.waves, args.bake, args.gate, args.max_failure_rate,
                           prefetch=args.prefetch)
    except RolloutError as e:
        ap.error(str(e))
    work = Path(tempfile.mkdtemp(prefix="fleet-waves-", dir=args.dir))
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    try:
        result = run(args, spec, work, say)
    finally:
        shutil.rmtree(work / "devices", ignore_errors=True)
        say(f"logs in {work}")
    result["plot"] = str(Path(args.plot) if args.plot else work / "bench-fleet-waves.png")
    plot(result, Path(result["plot"]), title(result))
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_tables(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
