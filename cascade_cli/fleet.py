"""``cascade fleet``: the fleet operator's commands, on the control plane's state under
``$CASCADE_HOME/fleet`` (on its host, whether or not ``cascade fleet serve`` runs), or with
``--url http://HOST:8090 [--admin-key K]`` (or $CASCADE_FLEET_URL, $CASCADE_FLEET_ADMIN_KEY) on
a control plane elsewhere, over its admin API (fleet_remote.py): the same operations
(model_distribution/fleet/operations.py), the same output. The devices' commands: fleet_devices.py.

    cascade fleet serve [--port 8090] [--broker mqtt://127.0.0.1:1883]
    cascade fleet keys init
    cascade fleet push ./model.gguf --name N --version V [--calibration edge.toml] [--min-agent-version V]
    cascade fleet models [--name N] [--json]
    cascade fleet devices add DEVICE --group G [--group G2]; cascade fleet devices [--group G] [--json]
    cascade fleet assign (DEVICE | --group G) NAME@VERSION
    cascade fleet rollout start|status|list|pause|resume|abort|rollback ...   (rollout.py)
"""

from __future__ import annotations

import json
import os
import sys

from cascade_cli.fleet_devices import cmd_devices_add, cmd_devices_list, open_device_store
from cascade_cli.fleet_remote import CLIENT_ENV, add_remote_flags, exit_on_refusal, remote_control_plane
from cascade_cli.parsing import add_command
from cascade_cli.rollout import add_rollout_parser
from cascade_cli.tables import print_table, printed_whole, utc_time


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

    remote = remote_control_plane(args)
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
    from cascade.units import format_size

    remote = remote_control_plane(args)
    if remote is not None:
        models = remote.call("GET", "/models", params={"name": args.name} if args.name else None)["data"]
    else:
        reg = _registry()
        try:
            models = [m.to_dict() for m in reg.models(args.name)]
        finally:
            reg.close()
    if printed_whole(models, args.json,
                     "no models published (cascade fleet push ./model.gguf --name NAME --version 1.0.0)"):
        return 0
    rows = [("NAME", "VERSION", "FORMAT", "QUANT", "SIZE", "SHA256", "PUSHED")]
    for m in models:
        pushed = utc_time(m["pushed_at"])
        rows.append((m["name"], m["version"], m["format"], m["quantization"], format_size(m["size"]),
                     m["sha256"][:16], pushed))
    print_table(rows)
    return 0



def cmd_assign(args) -> int:
    from model_distribution.fleet import operations
    from model_distribution.registry.store import RegistryError

    if (args.device is None) == (args.group is None):
        print("cascade: name one device or --group GROUP", file=sys.stderr)
        return 2
    remote = remote_control_plane(args)
    if remote is not None:
        done = remote.call("POST", "/assign", json={"model": args.version_ref, "device": args.device,
                                                    "group": args.group})
        ref, changed = done["model"], done["devices"]
    else:
        reg, store = _registry(), open_device_store()
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



def cmd_broker_files(args) -> int:
    from model_distribution.control_plane.broker import control_plane_credentials
    from model_distribution.control_plane.mosquitto_files import broker_files

    repo, store = _repository(), open_device_store()
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



def add_fleet_parser(sub) -> None:
    """``cascade fleet serve|keys|push|models|devices|broker-files|assign|rollout``."""
    fleet = add_command(sub, "fleet", "the fleet control plane: model registry, devices, rollouts").add_subparsers(
        dest="fleet_command", required=True, metavar="COMMAND")
    serve = add_command(fleet, "serve", "the control plane: artifacts (HTTP Range), signed TUF metadata, the "
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
    keys = add_command(fleet, "keys", "the control plane's signing keys").add_subparsers(
        dest="keys_command", required=True, metavar="COMMAND")
    init = add_command(keys, "init", "make the signing keys (root, targets offline; snapshot, timestamp, desired "
                                     "online) and the first TUF metadata")
    init.set_defaults(func=cmd_keys_init)
    push = add_command(fleet, "push", "publish a model file as name@version (immutable once published)")
    push.add_argument("path", help="the model file (.gguf), or an ONNX export directory (pushed as one tar)")
    push.add_argument("--name", required=True, help="the model's name, e.g. smollm2-135m")
    push.add_argument("--version", required=True, help="a semantic version, e.g. 1.1.0")
    push.add_argument("--calibration", help="an edge.toml whose [cascade] thresholds travel with this version")
    push.add_argument("--min-agent-version", help="the oldest agent version that may install it")
    push.add_argument("--json", action="store_true", help="print the manifest as JSON")
    add_remote_flags(push)
    push.set_defaults(func=exit_on_refusal(cmd_push))
    models = add_command(fleet, "models", "published model versions: name, version, format, quantization, size, "
                                          "sha256, pushed at")
    models.add_argument("--name", help="only this model's versions")
    models.add_argument("--json", action="store_true", help="print JSON (full sha256 and manifest)")
    add_remote_flags(models)
    models.set_defaults(func=exit_on_refusal(cmd_models))
    devices = add_command(fleet, "devices", "enrolled devices: groups, desired vs reported model, state, last seen")
    devices.add_argument("--group", help="only this group's devices")
    devices.add_argument("--json", action="store_true", help="print JSON")
    add_remote_flags(devices)
    devices.set_defaults(func=exit_on_refusal(cmd_devices_list))
    dsub = devices.add_subparsers(dest="devices_command", metavar="COMMAND")
    add = add_command(dsub, "add", "enrol a device: prints its credentials (once)")
    add.add_argument("device", help="the device id, e.g. kiosk-7")
    add.add_argument("--group", action="append", help="a group it belongs to (repeatable)")
    add.add_argument("--fleet", default="default", help="the fleet (the MQTT topic prefix)")
    add.add_argument("--json", action="store_true", help="print the credentials as JSON")
    add_remote_flags(add)
    add.set_defaults(func=exit_on_refusal(cmd_devices_add))
    bf = add_command(fleet, "broker-files", "Mosquitto password and ACL files: each device reads only its desired "
                                            "topic and writes only its own reported/events/status/telemetry")
    bf.add_argument("--out", required=True, help="the folder to write passwd and acl into")
    bf.set_defaults(func=cmd_broker_files)
    assign = add_command(fleet, "assign", "set the desired model version of a device or a group")
    assign.add_argument("device", nargs="?", help="the device id (or --group)")
    assign.add_argument("version_ref", metavar="NAME@VERSION", help="a published version, e.g. smollm2-135m@1.1.0")
    assign.add_argument("--group", help="every device of this group")
    add_remote_flags(assign)
    assign.set_defaults(func=exit_on_refusal(cmd_assign))
    add_rollout_parser(fleet)
