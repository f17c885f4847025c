"""``cascade fleet``: the fleet operator's commands, on the control plane's state under
``$CASCADE_HOME/fleet`` (on its host, whether or not ``cascade fleet serve`` runs), or with
``--url http://HOST:8090 [--admin-key K]`` (or $CASCADE_FLEET_URL, $CASCADE_FLEET_ADMIN_KEY) on
a control plane elsewhere, over its admin API: the same operations (operations.py), the same output.

    cascade fleet serve [--port 8090] [--broker mqtt://127.0.0.1:1883]
    cascade fleet keys init
    cascade fleet push ./model.gguf --name N --version V [--calibration edge.toml] [--min-agent-version V]
    cascade fleet models [--name N] [--json]
    cascade fleet devices add DEVICE --group G [--group G2]; cascade fleet devices [--group G] [--json]
    cascade fleet assign (DEVICE | --group G) NAME@VERSION
    cascade fleet rollout start|status|list|pause|resume|abort|rollback ...   (rollout_cli.py)
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from cascade.cli_help import utc_time
from model_distribution.fleet.devices import is_number


def _registry():
    from cascade.config import cascade_home
    from model_distribution.registry.store import Registry

    return Registry(cascade_home() / "fleet")


def _repository():
    from cascade.config import cascade_home
    from model_distribution.registry.signing import Repository

    return Repository(cascade_home() / "fleet")


def cmd_serve(args) -> int:
    from cascade.config import ConfigError
    from model_distribution.control_plane import server as control_plane

    overrides = {"server": {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}}
    mqtt = {k: v for k, v in (("broker", args.broker), ("listen_port", args.mqtt_port),
                              ("listen_host", args.mqtt_host), ("tls_port", args.mqtt_tls_port),
                              ("certfile", args.mqtt_certfile), ("keyfile", args.mqtt_keyfile)) if v is not None}
    if args.no_broker:
        mqtt["start"] = False
    if mqtt:
        overrides["mqtt"] = mqtt
    environ = {k: v for k, v in os.environ.items() if k not in CLIENT_ENV}
    try:
        config = control_plane.FleetConfig.load(args.config, overrides, environ)
    except ConfigError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    try:
        control_plane.run(config)
    except RuntimeError as e:  # the broker could not start (its port taken, ...)
        print(f"cascade: {e}", file=sys.stderr)
        return 1
    return 0


def cmd_keys_init(args) -> int:
    from model_distribution.registry.signing import SigningError

    repo = _repository()
    try:
        repo.init()
    except SigningError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    print(f"signing keys and TUF metadata written: keys in {repo.keys_dir} (root.pem and targets.pem are the offline "
          f"keys: keep copies off this host), metadata in {repo.metadata_dir}")
    print(f"a device trusts {repo.metadata_dir / '1.root.json'} and {repo.desired_key_file} (copy both to the device: "
          "[fleet] trust_root and desired_key)")
    return 0


def cmd_push(args) -> int:
    from model_distribution.fleet import operations
    from model_distribution.registry.signing import SigningError
    from model_distribution.registry.store import RegistryError

    remote = _remote(args)
    if remote is not None:
        _print_pushed(remote.push(args.path, args.name, args.version, args.calibration, args.min_agent_version),
                      args.json)
        return 0
    repo = _repository()
    if not repo.initialized:
        try:
            repo.init()
            print(f"cascade: no signing keys yet: made them under {repo.keys_dir} (cascade fleet keys init)",
                  file=sys.stderr)
        except SigningError as e:  # another push made them meanwhile (init runs under the publish lock)
            if not repo.initialized:
                print(f"cascade: {e}", file=sys.stderr)
                return 2
    reg = _registry()
    try:
        manifest, created = operations.push(reg, repo, args.path, args.name, args.version, args.calibration,
                                            args.min_agent_version)
    except (RegistryError, SigningError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    finally:
        reg.close()
    _print_pushed({**manifest.to_dict(), "created": created}, args.json)
    return 0


def _print_pushed(pushed: dict, as_json: bool) -> None:
    """A push's result (the manifest and ``created``), from the local registry or a remote one."""
    if as_json:
        print(json.dumps(pushed, indent=2))
    elif pushed["created"]:
        print(f"pushed {pushed['name']}@{pushed['version']}: {pushed['format']} {pushed['quantization']}, "
              f"{pushed['size']} bytes, sha256 {pushed['sha256']}")
    else:
        print(f"{pushed['name']}@{pushed['version']} is already published with these bytes (sha256 "
              f"{pushed['sha256']}): nothing to do")


def cmd_models(args) -> int:
    from cascade.cli_help import print_table
    from cascade.units import format_size

    remote = _remote(args)
    if remote is not None:
        models = remote.call("GET", "/models", params={"name": args.name} if args.name else None)["data"]
    else:
        reg = _registry()
        try:
            models = [m.to_dict() for m in reg.models(args.name)]
        finally:
            reg.close()
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    if not models:
        print("no models published (cascade fleet push ./model.gguf --name NAME --version 1.0.0)")
        return 0
    rows = [("NAME", "VERSION", "FORMAT", "QUANT", "SIZE", "SHA256", "PUSHED")]
    for m in models:
        pushed = utc_time(m["pushed_at"])
        rows.append((m["name"], m["version"], m["format"], m["quantization"], format_size(m["size"]),
                     m["sha256"][:16], pushed))
    print_table(rows)
    return 0


def _devices():
    from cascade.config import cascade_home
    from model_distribution.fleet.devices import DeviceStore

    (cascade_home() / "fleet").mkdir(parents=True, exist_ok=True)
    return DeviceStore(cascade_home() / "fleet")


def cmd_devices_add(args) -> int:
    from model_distribution.fleet import operations
    from model_distribution.registry.store import RegistryError

    remote = _remote(args)
    if remote is not None:
        creds = remote.call("POST", "/devices", json={"device": args.device, "groups": args.group or [],
                                                      "fleet": args.fleet})
    else:
        store = _devices()
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
    from cascade.cli_help import print_table

    remote = _remote(args)
    if remote is not None:  # the same rows (rollout_ops.device_rows), from the control plane
        devices = remote.call("GET", "/devices", params={"group": args.group} if args.group else None)["data"]
    else:
        from cascade.config import cascade_home
        from model_distribution.rollout import commands as rollout_ops
        from model_distribution.rollout.store import RolloutStore

        store, rollouts = _devices(), RolloutStore(cascade_home() / "fleet")
        try:
            devices = rollout_ops.device_rows(store, rollouts, args.group)
        finally:
            store.close()
            rollouts.close()
    if args.json:
        print(json.dumps(devices, indent=2))
        return 0
    if not devices:
        print("no devices enrolled (cascade fleet devices add DEVICE --group GROUP)")
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


def cmd_assign(args) -> int:
    from model_distribution.fleet import operations
    from model_distribution.registry.store import RegistryError

    if (args.device is None) == (args.group is None):
        print("cascade: name one device or --group GROUP", file=sys.stderr)
        return 2
    remote = _remote(args)
    if remote is not None:
        done = remote.call("POST", "/assign", json={"model": args.version_ref, "device": args.device,
                                                    "group": args.group})
        ref, changed = done["model"], done["devices"]
    else:
        reg, store = _registry(), _devices()
        try:
            manifest, devices = operations.assign(reg, store, args.version_ref, args.device, args.group)
            ref, changed = manifest.ref, [d.to_dict() for d in devices]
        except RegistryError as e:
            print(f"cascade: {e}", file=sys.stderr)
            return 2
        finally:
            reg.close()
            store.close()
    print(f"desired {ref} for {len(changed)} device(s): {', '.join(d['device'] for d in changed)}")
    return 0


# -- a remote control plane (--url) ------------------------------------------------------------

CLIENT_ENV = ("CASCADE_FLEET_URL", "CASCADE_FLEET_ADMIN_KEY")  # the client's, not fleet.toml overrides


class Refused(Exception):
    """A remote call that did not go through: the message (one line) and the exit code (2: the
    caller's, an unreachable control plane or a refused key; 1: the server failed)."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(" ".join(message.split()))
        self.exit_code = exit_code


class Remote:
    """The admin API (``/v1/fleet``) of a control plane on another host: what the local commands
    do, run there by the same operations."""

    def __init__(self, url: str, admin_key: str):
        from urllib.parse import urlsplit

        import httpx

        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise Refused(f"--url must be http(s)://HOST[:PORT], got {url!r}")
        self.url = url.rstrip("/")
        self.client = httpx.Client(base_url=f"{self.url}/v1/fleet", timeout=httpx.Timeout(60.0, connect=10.0),
                                   headers={"Authorization": f"Bearer {admin_key}"} if admin_key else {})

    def call(self, method: str, path: str, **kwargs) -> dict:
        import httpx

        try:
            r = self.client.request(method, path, **kwargs)
        except httpx.HTTPError as e:
            raise Refused(f"cannot reach the control plane at {self.url}: {e or e.__class__.__name__}") from e
        if r.status_code >= 400:
            try:
                message = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = r.text[:200] or r.reason_phrase
            hint = " (--admin-key or $CASCADE_FLEET_ADMIN_KEY)" if r.status_code in (401, 403) else ""
            raise Refused(f"{self.url}: HTTP {r.status_code}: {message}{hint}", 1 if r.status_code >= 500 else 2)
        try:
            return r.json()
        except ValueError as e:
            raise Refused(f"{self.url} answered HTTP {r.status_code} with no JSON: not a cascade control plane?",
                          1) from e

    def push(self, path: str, name: str, version: str, calibration: str | None,
             min_agent_version: str | None) -> dict:
        """Stream the file as the body of ``POST /v1/fleet/models`` (checked here first, so a typo
        is not found after gigabytes went over the network)."""
        import httpx

        from cascade.calibration import CalibrationError, check_calibration
        from model_distribution.registry.store import RegistryError, check_names, read_calibration

        file = Path(path)
        if file.is_dir():  # an ONNX export: sent as the one tar the registry makes of it (same sha256)
            import tempfile

            from model_distribution.artifacts.onnx_model import OnnxModelError, pack_onnx_dir

            with tempfile.TemporaryDirectory() as tmp:
                try:
                    check_names(name, version, min_agent_version)
                    pack_onnx_dir(file, Path(tmp) / "model.tar")
                except (RegistryError, OnnxModelError) as e:
                    raise Refused(str(e)) from e
                return self.push(str(Path(tmp) / "model.tar"), name, version, calibration, min_agent_version)
        try:
            check_names(name, version, min_agent_version)
            if not file.is_file():
                raise RegistryError(f"{file} is not a file (nor an ONNX export directory)")
            headers = {"Content-Type": "application/octet-stream", "Content-Length": str(file.stat().st_size)}
            if calibration is not None:  # checked here as the control plane will, its difficulty model inline
                table = check_calibration(read_calibration(calibration), Path(calibration).expanduser().parent)
                headers["X-Cascade-Calibration"] = json.dumps(table, allow_nan=False, separators=(",", ":"))
        except (RegistryError, CalibrationError) as e:
            raise Refused(str(e)) from e
        params = {"name": name, "version": version, **({"min_agent_version": min_agent_version}
                                                         if min_agent_version else {})}

        def chunks():
            with open(file, "rb") as f:
                while chunk := f.read(1 << 20):
                    yield chunk

        # the server hashes and stores the file before it answers: allow it the time
        return self.call("POST", "/models", params=params, content=chunks(), headers=headers,
                         timeout=httpx.Timeout(60.0, connect=10.0, read=900.0))


def _remote(args) -> Remote | None:
    """The control plane named by ``--url`` / $CASCADE_FLEET_URL, or None: the local state."""
    url = getattr(args, "url", None) or os.environ.get("CASCADE_FLEET_URL")
    if not url:
        return None
    return Remote(url, getattr(args, "admin_key", None) or os.environ.get("CASCADE_FLEET_ADMIN_KEY", ""))


def _refusals_exit(cmd):
    """A command that may run remotely: a refused call is one line on stderr and its exit code."""
    def run(args) -> int:
        try:
            return cmd(args)
        except Refused as e:
            print(f"cascade: {e}", file=sys.stderr)
            return e.exit_code
    run.__name__, run.__doc__ = cmd.__name__, cmd.__doc__
    return run


def _remote_flags(parser) -> None:
    # SUPPRESS: `devices --url U add D` and `devices add D --url U` both work (no subparser default wins)
    parser.add_argument("--url", default=argparse.SUPPRESS,
                        help="a control plane on another host, http://HOST:8090 (default: $CASCADE_FLEET_URL; "
                             "none: the state under $CASCADE_HOME/fleet)")
    parser.add_argument("--admin-key", default=argparse.SUPPRESS,
                        help="its [server] admin_key (default: $CASCADE_FLEET_ADMIN_KEY)")


def cmd_broker_files(args) -> int:
    from model_distribution.control_plane.broker import control_plane_credentials
    from model_distribution.control_plane.mosquitto_files import broker_files

    repo, store = _repository(), _devices()
    try:
        user, secret = control_plane_credentials(repo.keys_dir)
        passwd, acl = broker_files(store, args.out, user, secret)
    finally:
        store.close()
    print(f"wrote {passwd} and {acl}; in mosquitto.conf:")
    print(f"  allow_anonymous false\n  password_file {passwd}\n  acl_file {acl}\n  use_username_as_clientid true"
          "\n  max_packet_size 262144\n  max_queued_messages 200000")
    print(f"the control plane connects as {user!r} with the secret in {repo.keys_dir / 'mqtt-control-plane.secret'} "
          "([mqtt] username / password of fleet.toml); re-run after enrolling devices")
    return 0


def add_fleet_parser(sub, make_parser) -> None:
    """``cascade fleet ...`` under ``sub`` (``make_parser(sub, name, help)`` builds each parser)."""
    fleet = make_parser(sub, "fleet", "the fleet control plane: model registry, devices, rollouts").add_subparsers(
        dest="fleet_command", required=True, metavar="COMMAND")
    serve = make_parser(fleet, "serve", "the control plane: artifacts (HTTP Range), signed TUF metadata, the "
                        "operator's endpoints")
    serve.add_argument("--config", help="fleet.toml (default: none)")
    serve.add_argument("--host", help="address to listen on (default: 127.0.0.1)")
    serve.add_argument("--port", type=int, help="port to listen on (default: 8090)")
    serve.add_argument("--broker", help="mqtt://HOST:PORT of a broker for desired/reported state (default: start "
                       "the fleet's own: Mosquitto when installed, else an embedded one)")
    serve.add_argument("--mqtt-port", type=int, help="port of the broker it starts (default: 1883)")
    serve.add_argument("--mqtt-host", help="address of the broker it starts (default: 127.0.0.1)")
    serve.add_argument("--mqtt-tls-port", type=int, help="the broker it starts also listens with TLS on this port "
                       "(devices use mqtts://HOST:PORT; default: no TLS listener)")
    serve.add_argument("--mqtt-certfile", help="that listener's certificate chain (PEM)")
    serve.add_argument("--mqtt-keyfile", help="that listener's private key (PEM)")
    serve.add_argument("--no-broker", action="store_true", help="start no broker (HTTP only)")
    serve.set_defaults(func=cmd_serve)
    keys = make_parser(fleet, "keys", "the control plane's signing keys").add_subparsers(
        dest="keys_command", required=True, metavar="COMMAND")
    init = make_parser(keys, "init", "make the signing keys (root, targets offline; snapshot, timestamp, desired "
                       "online) and the first TUF metadata")
    init.set_defaults(func=cmd_keys_init)
    push = make_parser(fleet, "push", "publish a model file as name@version (immutable once published)")
    push.add_argument("path", help="the model file (.gguf), or an ONNX export directory (pushed as one tar)")
    push.add_argument("--name", required=True, help="the model's name, e.g. smollm2-135m")
    push.add_argument("--version", required=True, help="a semantic version, e.g. 1.1.0")
    push.add_argument("--calibration", help="an edge.toml whose [cascade] thresholds travel with this version")
    push.add_argument("--min-agent-version", help="the oldest agent version that may install it")
    push.add_argument("--json", action="store_true", help="print the manifest as JSON")
    _remote_flags(push)
    push.set_defaults(func=_refusals_exit(cmd_push))
    models = make_parser(fleet, "models", "published model versions: name, version, format, quantization, size, "
                         "sha256, pushed at")
    models.add_argument("--name", help="only this model's versions")
    models.add_argument("--json", action="store_true", help="print JSON (full sha256 and manifest)")
    _remote_flags(models)
    models.set_defaults(func=_refusals_exit(cmd_models))
    devices = make_parser(fleet, "devices", "enrolled devices: groups, desired vs reported model, state, last seen")
    devices.add_argument("--group", help="only this group's devices")
    devices.add_argument("--json", action="store_true", help="print JSON")
    _remote_flags(devices)
    devices.set_defaults(func=_refusals_exit(cmd_devices_list))
    dsub = devices.add_subparsers(dest="devices_command", metavar="COMMAND")
    add = make_parser(dsub, "add", "enrol a device: prints its credentials (once)")
    add.add_argument("device", help="the device id, e.g. kiosk-7")
    add.add_argument("--group", action="append", help="a group it belongs to (repeatable)")
    add.add_argument("--fleet", default="default", help="the fleet (the MQTT topic prefix)")
    add.add_argument("--json", action="store_true", help="print the credentials as JSON")
    _remote_flags(add)
    add.set_defaults(func=_refusals_exit(cmd_devices_add))
    bf = make_parser(fleet, "broker-files", "Mosquitto password and ACL files: each device reads only its desired "
                     "topic and writes only its own reported/events/status/telemetry")
    bf.add_argument("--out", required=True, help="the folder to write passwd and acl into")
    bf.set_defaults(func=cmd_broker_files)
    assign = make_parser(fleet, "assign", "set the desired model version of a device or a group")
    assign.add_argument("device", nargs="?", help="the device id (or --group)")
    assign.add_argument("version_ref", metavar="NAME@VERSION", help="a published version, e.g. smollm2-135m@1.1.0")
    assign.add_argument("--group", help="every device of this group")
    _remote_flags(assign)
    assign.set_defaults(func=_refusals_exit(cmd_assign))
    from model_distribution.rollout_cli import add_rollout_parser

    add_rollout_parser(fleet, make_parser)
