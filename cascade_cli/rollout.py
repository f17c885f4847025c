"""``cascade fleet rollout ...``: staged rollouts, on the control plane's state under
``$CASCADE_HOME/fleet`` or with ``--url`` on a control plane elsewhere (its
``/v1/fleet/rollouts``), printed from the same dicts either way (model_distribution/rollout/commands.py;
the status as text: rollout_view.py).

    cascade fleet rollout start NAME@VERSION --group G [--waves 1,10,50,100] [--bake 2m]
        [--max-failure-rate 0.02] [--min-executed 5] [--gate "escalation_rate<=+0.05" ...]
        [--min-requests 50] [--step-timeout 10m]
    cascade fleet rollout status ROLLOUT [--watch] [--json]
    cascade fleet rollout pause|resume|abort|rollback ROLLOUT
    cascade fleet rollout list [--json]

The controller in ``cascade fleet serve`` moves a rollout; these commands start it, show it and
steer it. Bad input is refused (exit 2, one line) before anything is written.
"""

from __future__ import annotations

import json
import sys
import time
from urllib.parse import quote

from cascade_cli.fleet_remote import add_remote_flags, exit_on_refusal, remote_control_plane
from cascade_cli.parsing import add_command
from cascade_cli.rollout_view import render_status
from cascade_cli.tables import print_table, printed_whole, utc_time


class _Local:
    """The stores under $CASCADE_HOME/fleet, opened once per command."""

    def __init__(self):
        from cascade.config import cascade_home
        from model_distribution.fleet.devices import DeviceStore
        from model_distribution.registry.store import Registry
        from model_distribution.rollout.store import RolloutStore

        root = cascade_home() / "fleet"
        self.registry, self.devices, self.rollouts = Registry(root), DeviceStore(root), RolloutStore(root)

    def close(self) -> None:
        self.registry.close()
        self.devices.close()
        self.rollouts.close()


def _run_local(work):
    """``work(local)`` on the local stores; a refused operation is one line on stderr and exit 2."""
    from model_distribution.registry.store import RegistryError

    local = _Local()
    try:
        return work(local)
    except RegistryError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return None
    finally:
        local.close()


def cmd_rollout_start(args) -> int:
    from model_distribution.rollout import commands as rollout_ops
    from model_distribution.rollout.spec import RolloutError, RolloutSpec

    try:  # bad arguments are refused before anything opens the store (or goes over the network)
        spec = RolloutSpec(args.version_ref, args.group, waves=args.waves, bake_s=args.bake, gates=args.gate or [],
                           max_failure_rate=args.max_failure_rate, min_executed=args.min_executed,
                           min_requests=args.min_requests, min_devices=args.min_devices,
                           step_timeout_s=args.step_timeout,
                           window=args.window, jitter_s=args.jitter, prefetch=not args.no_prefetch)
    except RolloutError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    remote = remote_control_plane(args)
    if remote is not None:
        from dataclasses import asdict

        started = remote.call("POST", "/rollouts", json=asdict(spec))
        shown = remote.call("GET", f"/rollouts/{quote(started['rollout'], safe='')}")
    else:
        shown = _run_local(lambda s: rollout_ops.status(
            s.rollouts, rollout_ops.start(s.registry, s.devices, s.rollouts, spec).rollout_id))
        if shown is None:
            return 2
    sizes = [sum(1 for e in shown["executions"] if e["wave"] == k) for k in range(len(shown["waves"]))]
    waves = ", ".join(f"{w}% {n}" for w, n in zip(shown["waves"], sizes, strict=True))
    print(f"rollout {shown['rollout']} started: {shown['model']} to group {shown['group']}, "
          f"{len(shown['executions'])} device(s) in {len(sizes)} waves ({waves})")
    print(f"follow it: cascade fleet rollout status {shown['rollout']} --watch")
    return 0


def _status_source(args):
    """(fetch, close): ``fetch()`` is the rollout's status dict, from --url or the local store."""
    from model_distribution.rollout import commands as rollout_ops

    remote = remote_control_plane(args)
    if remote is not None:
        return (lambda: remote.call("GET", f"/rollouts/{quote(args.rollout, safe='')}")), (lambda: None)
    local = _Local()
    return (lambda: rollout_ops.status(local.rollouts, args.rollout)), local.close


def cmd_rollout_status(args) -> int:
    from model_distribution.registry.store import RegistryError

    fetch, close = _status_source(args)
    last = None
    try:
        while True:
            shown = fetch()
            if args.json:
                text = json.dumps(shown, separators=(",", ":")) if args.watch else json.dumps(shown, indent=2)
            else:
                text = render_status(shown)
            if args.watch and not args.json and sys.stdout.isatty():
                sys.stdout.write("\033[H\033[2J" + text + "\n")  # redraw in place
            elif text != last:  # into a pipe or a file: each change once
                print(text + ("" if args.json or not args.watch else "\n"))
            sys.stdout.flush()
            last = text
            if not args.watch or shown["state"] != "RUNNING":
                return 0
            time.sleep(1)
    except KeyboardInterrupt:
        return 0
    except RegistryError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    finally:
        close()



def cmd_rollout_list(args) -> int:
    remote = remote_control_plane(args)
    if remote is not None:
        rollouts = remote.call("GET", "/rollouts")["data"]
    else:
        rollouts = _run_local(lambda s: [r.to_dict() for r in s.rollouts.list()])
        if rollouts is None:
            return 2
    if printed_whole(rollouts, args.json, "no rollouts (cascade fleet rollout start NAME@VERSION --group GROUP)"):
        return 0
    rows = [("ROLLOUT", "MODEL", "GROUP", "STATE", "WAVE", "STARTED", "REASON")]
    for r in rollouts:
        started = utc_time(r["created_at"])
        rows.append((r["rollout"], r["model"], r["group"], r["state"],
                     f"{r['wave'] + 1}/{len(r['waves'])} ({r['waves'][r['wave']]}%)", started, r["reason"] or "-"))
    print_table(rows)
    return 0


def _steer(action: str):
    def cmd(args) -> int:
        from model_distribution.rollout import commands as rollout_ops

        remote = remote_control_plane(args)
        if remote is not None:
            r = remote.call("POST", f"/rollouts/{quote(args.rollout, safe='')}/{action}")
        else:
            r = _run_local(lambda s: rollout_ops.command(s.registry, s.devices, s.rollouts, args.rollout, action))
            if r is None:
                return 2
        reason = f" ({r['reason']})" if r["reason"] else ""
        print(f"rollout {r['rollout']}: {r['state']}{reason}")
        return 0
    cmd.__name__ = f"cmd_rollout_{action}"
    return cmd


cmd_rollout_pause, cmd_rollout_resume = _steer("pause"), _steer("resume")
cmd_rollout_abort, cmd_rollout_rollback = _steer("abort"), _steer("rollback")


def add_rollout_parser(fleet) -> None:
    """``cascade fleet rollout start|status|pause|resume|abort|rollback|list``."""
    rollout = add_command(fleet, "rollout", "staged rollouts: a version to a group in waves, each gated on install "
                          "health and serving quality against the devices not yet updated").add_subparsers(
        dest="rollout_command", required=True, metavar="COMMAND")
    start = add_command(rollout, "start", "start rolling NAME@VERSION out to a group (the controller in cascade "
                                          "fleet serve moves it)")
    start.add_argument("version_ref", metavar="NAME@VERSION", help="a published version, e.g. smollm2-135m@1.2.0")
    start.add_argument("--group", required=True, help="the group to roll it out to")
    start.add_argument("--waves", default="1,10,50,100", help="cumulative percentages of the group, the last 100")
    start.add_argument("--bake", default="0", help="how long a wave runs once its devices are done, before its "
                       "gates are judged: seconds, or 90s, 2m, 1h")
    start.add_argument("--max-failure-rate", type=float, default=0.0,
                       help="install failures (FAILED, TIMED_OUT, REJECTED) over executed above this roll back")
    start.add_argument("--min-executed", type=int, default=1,
                       help="the failure rate is judged after this many devices executed")
    start.add_argument("--gate", action="append", metavar="GATE",
                       help="a serving gate, updated vs the devices not yet updated over the bake (repeatable): "
                       "escalation_rate<=+0.05 (a difference), ttft_p95<=1.2x (a ratio), error_rate<=0.01 "
                       "(absolute), decode_tps>=0.9x")
    start.add_argument("--min-requests", type=int, default=0,
                       help="requests each side needs before the gates are judged (else it pauses as inconclusive)")
    start.add_argument("--min-devices", type=int, default=1,
                       help="a gate's value is a request-weighted mean over each side's devices (none weighing more "
                       "than the median device, the highest and lowest left out from four devices on): judged once "
                       "this many have one (else it pauses as inconclusive); 4 keeps any one device from moving it")
    start.add_argument("--step-timeout", default="10m", help="a device that says nothing new for this long is "
                       "TIMED_OUT")
    start.add_argument("--window", help="activate only inside HH:MM-HH:MM of each device's local time, or in the "
                       "minutes a five-field cron expression matches ('* 2-4 * * 1-5': 02:00-04:59 on weekdays); it "
                       "downloads whenever; a wave waits for its devices' windows and bakes from when they activate")
    start.add_argument("--jitter", default="0", help="each device waits a random 0..JITTER before it downloads, so a "
                       "wave does not reach the artifact server at one instant (e.g. 30s)")
    start.add_argument("--no-prefetch", action="store_true", help="devices of later waves do not download ahead "
                       "(by default they fetch and verify while earlier waves bake; only activation is gated)")
    add_remote_flags(start)
    start.set_defaults(func=exit_on_refusal(cmd_rollout_start))
    status = add_command(rollout, "status", "a rollout: its waves, the devices' states, each wave's decision with "
                                            "its numbers, the devices under way")
    status.add_argument("rollout", metavar="ROLLOUT", help="the rollout id (cascade fleet rollout list)")
    status.add_argument("--watch", action="store_true", help="redraw every second while it runs")
    status.add_argument("--json", action="store_true", help="print the rollout, its executions and decisions as JSON")
    add_remote_flags(status)
    status.set_defaults(func=exit_on_refusal(cmd_rollout_status))
    for action, cmd, help_ in (
            ("pause", cmd_rollout_pause, "no new wave is told (the devices told go on)"),
            ("resume", cmd_rollout_resume, "go on (one paused as inconclusive goes to its next wave)"),
            ("abort", cmd_rollout_abort, "stop: the queued devices are canceled, the ones told keep the version"),
            ("rollback", cmd_rollout_rollback, "every device told goes back to the version it had")):
        p = add_command(rollout, action, help_)
        p.add_argument("rollout", metavar="ROLLOUT", help="the rollout id")
        add_remote_flags(p)
        p.set_defaults(func=exit_on_refusal(cmd))
    ls = add_command(rollout, "list", "rollouts, newest first: model, group, state, wave, started, reason")
    ls.add_argument("--json", action="store_true", help="print JSON")
    add_remote_flags(ls)
    ls.set_defaults(func=exit_on_refusal(cmd_rollout_list))
