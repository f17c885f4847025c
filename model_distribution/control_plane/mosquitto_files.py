"""Mosquitto's ``password_file`` and ``acl_file`` for the enrolled devices (never a reserved name:
``DeviceStore.broker_entries`` leaves those out) and the control plane, written atomically:
Mosquitto rereads them on SIGHUP. The ACL is the rule ``broker_acl.allowed`` keeps in the
embedded broker."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from model_distribution.fleet.device_secrets import mosquitto_hash
from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol.topics import DEVICE_WRITES


def broker_files(store: DeviceStore, out_dir: Path | str, control_plane_user: str, control_plane_secret: str
                 ) -> tuple[Path, Path]:
    """Mosquitto's ``password_file`` and ``acl_file`` for the enrolled devices and the control
    plane: a device may read only its own desired topic and write only its own reported, events,
    status and telemetry topics; the control plane reads and writes ``cascade/v1/#``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries = store.broker_entries()
    passwd = [f"{control_plane_user}:{mosquitto_hash(control_plane_secret)}"]
    acl = [f"user {control_plane_user}", "topic readwrite cascade/v1/#", ""]
    for device, fleet, hashed in entries:
        passwd.append(f"{device}:{hashed}")
        base = f"cascade/v1/{fleet}/devices/{device}"
        acl += [f"user {device}", f"topic read {base}/desired", *(f"topic write {base}/{k}" for k in DEVICE_WRITES), ""]
    pw_path, acl_path = out / "passwd", out / "acl"
    _write_file(pw_path, "\n".join(passwd) + "\n", 0o600)  # Mosquitto rereads them on SIGHUP: never half written
    _write_file(acl_path, "\n".join(acl) + "\n", 0o644)
    return pw_path, acl_path


def _write_file(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)
