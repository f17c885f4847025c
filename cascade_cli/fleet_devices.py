"""``cascade fleet devices``: enrol a device (``add``) and list the fleet's devices with what each
one reported, locally or on a control plane elsewhere (``--url``)."""

from __future__ import annotations

import json
import sys

from cascade_cli.fleet_remote import remote_control_plane
from cascade_cli.tables import print_table, printed_whole, utc_time
from model_distribution.fleet.devices import is_number


def open_device_store():
    """The device store under $CASCADE_HOME/fleet (made when missing)."""
    from cascade.config import cascade_home
    from model_distribution.fleet.devices import DeviceStore

    (cascade_home() / "fleet").mkdir(parents=True, exist_ok=True)
    return DeviceStore(cascade_home() / "fleet")


def cmd_devices_add(args) -> int:
    from model_distribution.fleet import operations
    from model_distribution.registry.store import RegistryError

    remote = remote_control_plane(args)
    if remote is not None:
        creds = remote.call("POST", "/devices", json={"device": args.device, "groups": args.group or [],
                                                      "fleet": args.fleet})
    else:
        store = open_device_store()
        try:
            creds = operations.enrol(store, args.device, args.group or [], args.fleet)
        except RegistryError as e:
            print(f"cascade: {e}", file=sys.stderr)
            return 2
        finally:
            store.close()
    if args.json:
        print(json.dumps(creds, indent=2))
    else:
        print(f"enrolled {creds['device']} (fleet {creds['fleet']}, groups {', '.join(creds['groups']) or '-'}); "
              "its credentials, shown once: put them in the device's edge.toml [fleet] section")
        print(f"device_id = \"{creds['device']}\"\nsecret = \"{creds['secret']}\"")
    return 0


def cmd_devices_list(args) -> int:
    remote = remote_control_plane(args)
    if remote is not None:  # the same rows (rollout_ops.device_rows), from the control plane
        devices = remote.call("GET", "/devices", params={"group": args.group} if args.group else None)["data"]
    else:
        from cascade.config import cascade_home
        from model_distribution.rollout import commands as rollout_ops
        from model_distribution.rollout.store import RolloutStore

        store, rollouts = open_device_store(), RolloutStore(cascade_home() / "fleet")
        try:
            devices = rollout_ops.device_rows(store, rollouts, args.group)
        finally:
            store.close()
            rollouts.close()
    if printed_whole(devices, args.json, "no devices enrolled (cascade fleet devices add DEVICE --group GROUP)"):
        return 0
    rows = [("DEVICE", "GROUPS", "ONLINE", "DESIRED", "REPORTED", "STATE", "ROLLOUT", "LAST SEEN", "REQUESTS",
             "ESCALATED", "ERRORS", "BACKLOG")]
    for d in devices:  # what a device reported is its own say: shown only where it has the right type
        rep = d["reported"] if isinstance(d["reported"], dict) else {}
        seen = "-" if d["last_seen"] is None else utc_time(d["last_seen"])
        state = _text(rep.get("state"))
        done, total = rep.get("done"), rep.get("total")
        if state == "DOWNLOADING" and is_number(done) and is_number(total) and total > 0:
            state = f"DOWNLOADING {min(100, max(0, int(100 * done / total)))}%"
        online = {True: "yes", False: "no"}.get(d.get("online"), "-")
        rollout = (d.get("rollout") or {}).get("state") or "-"  # its latest rollout's execution
        rows.append((d["device"], ",".join(d["groups"]) or "-", online, d["desired"] or "-", _text(rep.get("model")),
                     state, rollout, seen, _number(d.get("requests")), _percent(d.get("escalation_rate")),
                     _percent(d.get("error_rate")), _number(d.get("backlog"))))
    print_table(rows)
    for d in devices:  # why a version was refused or failed: the reason, in full
        rep = d["reported"] if isinstance(d["reported"], dict) else {}
        if isinstance(rep.get("reason"), str) and rep["reason"]:
            print(f"{d['device']}: {_text(rep.get('desired'))} {_text(rep.get('state'))}: {_text(rep['reason'], 500)}")
    return 0



def _text(value, limit: int = 40) -> str:
    """A device-supplied string for a table cell: printable, bounded, "-" when it is not a string."""
    if not isinstance(value, str) or not value:
        return "-"
    clean = "".join(c if c.isprintable() else "?" for c in value)
    return clean if len(clean) <= limit else clean[:limit - 1] + "…"


def _number(value) -> str:
    return str(int(value)) if is_number(value) else "-"


def _percent(rate) -> str:
    return f"{100 * rate:.1f}%" if is_number(rate) else "-"


