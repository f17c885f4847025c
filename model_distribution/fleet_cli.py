"""``cascade fleet``: the fleet operator's commands, on the control plane's state under
``$CASCADE_HOME/fleet`` (whether or not ``cascade fleet serve`` runs).

    cascade fleet serve [--port 8090] [--broker mqtt://127.0.0.1:1883]
    cascade fleet keys init
    cascade fleet push ./model.gguf --name N --version V [--calibration edge.toml] [--min-agent-version V]
    cascade fleet models [--name N] [--json]
    cascade fleet devices add DEVICE --group G [--group G2]; cascade fleet devices [--group G] [--json]
    cascade fleet assign (DEVICE | --group G) NAME@VERSION
"""

from __future__ import annotations

import datetime
import json
import sys


def _registry():
    from cascade.config import cascade_home
    from model_distribution.registry import Registry

    return Registry(cascade_home() / "fleet")


def _repository():
    from cascade.config import cascade_home
    from model_distribution.signing import Repository

    return Repository(cascade_home() / "fleet")


def cmd_serve(args) -> int:
    from cascade.config import ConfigError
    from model_distribution import control_plane

    overrides = {"server": {k: v for k, v in (("host", args.host), ("port", args.port)) if v is not None}}
    if args.broker:
        overrides["mqtt"] = {"broker": args.broker}
    try:
        config = control_plane.FleetConfig.load(args.config, overrides)
    except ConfigError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    control_plane.run(config)
    return 0


def cmd_keys_init(args) -> int:
    from model_distribution.signing import SigningError

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
    from model_distribution.registry import RegistryError
    from model_distribution.signing import SigningError

    repo = _repository()
    if not repo.initialized:
        repo.init()
        print(f"cascade: no signing keys yet: made them under {repo.keys_dir} (cascade fleet keys init)",
              file=sys.stderr)
    reg = _registry()
    try:
        manifest, created = reg.push(args.path, args.name, args.version, args.calibration, args.min_agent_version)
        if not repo.has_target(manifest.name, manifest.version):  # signed: what devices verify before install
            repo.add_target(manifest.name, manifest.version, manifest.sha256, manifest.size, manifest.signable())
    except (RegistryError, SigningError) as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    finally:
        reg.close()
    if args.json:
        print(json.dumps({**manifest.to_dict(), "created": created}, indent=2))
    elif created:
        print(f"pushed {manifest.ref}: {manifest.format} {manifest.quantization}, {manifest.size} bytes, "
              f"sha256 {manifest.sha256}")
    else:
        print(f"{manifest.ref} is already published with these bytes (sha256 {manifest.sha256}): nothing to do")
    return 0


def cmd_models(args) -> int:
    from cascade.cli_help import print_table
    from cascade.units import format_size

    reg = _registry()
    try:
        models = reg.models(args.name)
    finally:
        reg.close()
    if args.json:
        print(json.dumps([m.to_dict() for m in models], indent=2))
        return 0
    if not models:
        print("no models published (cascade fleet push ./model.gguf --name NAME --version 1.0.0)")
        return 0
    rows = [("NAME", "VERSION", "FORMAT", "QUANT", "SIZE", "SHA256", "PUSHED")]
    for m in models:
        pushed = datetime.datetime.fromtimestamp(m.pushed_at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        rows.append((m.name, m.version, m.format, m.quantization, format_size(m.size), m.sha256[:16], pushed))
    print_table(rows)
    return 0


def _devices():
    from cascade.config import cascade_home
    from model_distribution.devices import DeviceStore

    (cascade_home() / "fleet").mkdir(parents=True, exist_ok=True)
    return DeviceStore(cascade_home() / "fleet")


def cmd_devices_add(args) -> int:
    from model_distribution.registry import RegistryError

    store = _devices()
    try:
        secret = store.add(args.device, args.group or [], args.fleet)
    except RegistryError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    finally:
        store.close()
    creds = {"device": args.device, "fleet": args.fleet, "groups": args.group or [], "secret": secret}
    if args.json:
        print(json.dumps(creds, indent=2))
    else:
        print(f"enrolled {args.device} (fleet {args.fleet}, groups {', '.join(args.group or []) or '-'}); its "
              "credentials, shown once: put them in the device's edge.toml [fleet] section")
        print(f"device_id = \"{args.device}\"\nsecret = \"{secret}\"")
    return 0


def cmd_devices_list(args) -> int:
    from cascade.cli_help import print_table

    store = _devices()
    try:
        devices = store.list(group=args.group, serving=True)
    finally:
        store.close()
    if args.json:
        print(json.dumps([d.to_dict() for d in devices], indent=2))
        return 0
    if not devices:
        print("no devices enrolled (cascade fleet devices add DEVICE --group GROUP)")
        return 0
    rows = [("DEVICE", "GROUPS", "DESIRED", "REPORTED", "STATE", "LAST SEEN")]
    for d in devices:
        rep = d.reported or {}
        seen = "-" if d.last_seen is None else datetime.datetime.fromtimestamp(
            d.last_seen, datetime.UTC).strftime("%Y-%m-%d %H:%M:%SZ")
        rows.append((d.device_id, ",".join(d.groups) or "-", d.desired or "-", rep.get("model") or "-",
                     rep.get("state") or "-", seen))
    print_table(rows)
    return 0


def cmd_assign(args) -> int:
    from model_distribution.registry import RegistryError

    if (args.device is None) == (args.group is None):
        print("cascade: name one device or --group GROUP", file=sys.stderr)
        return 2
    reg, store = _registry(), _devices()
    try:
        manifest = reg.resolve(args.version_ref)
        changed = store.assign(manifest, device_id=args.device, group=args.group)
    except RegistryError as e:
        print(f"cascade: {e}", file=sys.stderr)
        return 2
    finally:
        reg.close()
        store.close()
    print(f"desired {manifest.ref} for {len(changed)} device(s): {', '.join(d.device_id for d in changed)}")
    return 0


def control_plane_credentials(keys_dir) -> tuple[str, str]:
    """The control plane's own broker user and secret (made once, kept beside the keys, mode 0600)."""
    import os
    import secrets

    path = keys_dir / "mqtt-control-plane.secret"
    if not path.exists():
        keys_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(24))
    return "cascade-control-plane", path.read_text().strip()


def cmd_broker_files(args) -> int:
    from model_distribution.devices import broker_files

    repo, store = _repository(), _devices()
    try:
        user, secret = control_plane_credentials(repo.keys_dir)
        passwd, acl = broker_files(store, args.out, user, secret)
    finally:
        store.close()
    print(f"wrote {passwd} and {acl}; in mosquitto.conf:")
    print(f"  allow_anonymous false\n  password_file {passwd}\n  acl_file {acl}")
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
    serve.add_argument("--broker", help="mqtt://HOST:PORT for desired/reported state (default: [mqtt] broker, none)")
    serve.set_defaults(func=cmd_serve)
    keys = make_parser(fleet, "keys", "the control plane's signing keys").add_subparsers(
        dest="keys_command", required=True, metavar="COMMAND")
    init = make_parser(keys, "init", "make the signing keys (root, targets offline; snapshot, timestamp, desired "
                       "online) and the first TUF metadata")
    init.set_defaults(func=cmd_keys_init)
    push = make_parser(fleet, "push", "publish a model file as name@version (immutable once published)")
    push.add_argument("path", help="the model file (.gguf)")
    push.add_argument("--name", required=True, help="the model's name, e.g. smollm2-135m")
    push.add_argument("--version", required=True, help="a semantic version, e.g. 1.1.0")
    push.add_argument("--calibration", help="an edge.toml whose [cascade] thresholds travel with this version")
    push.add_argument("--min-agent-version", help="the oldest agent version that may install it")
    push.add_argument("--json", action="store_true", help="print the manifest as JSON")
    push.set_defaults(func=cmd_push)
    models = make_parser(fleet, "models", "published model versions: name, version, format, quantization, size, "
                         "sha256, pushed at")
    models.add_argument("--name", help="only this model's versions")
    models.add_argument("--json", action="store_true", help="print JSON (full sha256 and manifest)")
    models.set_defaults(func=cmd_models)
    devices = make_parser(fleet, "devices", "enrolled devices: groups, desired vs reported model, state, last seen")
    devices.add_argument("--group", help="only this group's devices")
    devices.add_argument("--json", action="store_true", help="print JSON")
    devices.set_defaults(func=cmd_devices_list)
    dsub = devices.add_subparsers(dest="devices_command", metavar="COMMAND")
    add = make_parser(dsub, "add", "enrol a device: prints its credentials (once)")
    add.add_argument("device", help="the device id, e.g. kiosk-7")
    add.add_argument("--group", action="append", help="a group it belongs to (repeatable)")
    add.add_argument("--fleet", default="default", help="the fleet (the MQTT topic prefix)")
    add.add_argument("--json", action="store_true", help="print the credentials as JSON")
    add.set_defaults(func=cmd_devices_add)
    bf = make_parser(fleet, "broker-files", "Mosquitto password and ACL files: each device reads only its desired "
                     "topic and writes only its own reported/events/status/telemetry")
    bf.add_argument("--out", required=True, help="the folder to write passwd and acl into")
    bf.set_defaults(func=cmd_broker_files)
    assign = make_parser(fleet, "assign", "set the desired model version of a device or a group")
    assign.add_argument("device", nargs="?", help="the device id (or --group)")
    assign.add_argument("version_ref", metavar="NAME@VERSION", help="a published version, e.g. smollm2-135m@1.1.0")
    assign.add_argument("--group", help="every device of this group")
    assign.set_defaults(func=cmd_assign)
