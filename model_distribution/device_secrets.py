"""Device secrets and what brokers need of them: the salted hash the control plane checks a
device's HTTP credentials against, the PBKDF2 form Mosquitto's password file takes, and
Mosquitto's ``password_file`` and ``acl_file`` for the enrolled devices (never a reserved name:
``DeviceStore.broker_entries`` leaves those out)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from model_distribution.devices import DeviceStore


def _hash_secret(secret: str, salt: bytes | None = None, kind: str = "sha256") -> str:
    """A salted hash of a device secret. The secrets are 192-bit random tokens, which no guessing
    reaches, so a fast keyed hash (HMAC-SHA256) is as safe as a slow one and lets the control
    plane check a fleet's requests without spending ~70 ms of CPU each (a slow KDF is for secrets
    people choose). Stores made earlier hold scrypt hashes, which are still checked."""
    salt = salt or secrets.token_bytes(16)
    if kind == "scrypt":
        digest = hashlib.scrypt(secret.encode(), salt=salt, n=2**14, r=8, p=1, dklen=32)
    else:
        digest = hmac.new(salt, secret.encode(), hashlib.sha256).digest()
    return f"{kind}${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


def mosquitto_hash(secret: str) -> str:
    """The secret as a Mosquitto 2 password file stores it ($7$: PBKDF2-SHA512, 101 rounds, 12-byte salt)."""
    salt = secrets.token_bytes(12)
    digest = hashlib.pbkdf2_hmac("sha512", secret.encode(), salt, 101, 64)
    return f"$7$101${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


DEVICE_WRITES = ("reported", "events", "status", "telemetry")


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


def check_secret(secret: str, stored: str) -> bool:
    try:
        kind, salt, _ = stored.split("$")
        if kind not in ("sha256", "scrypt"):
            return False
        return hmac.compare_digest(_hash_secret(secret, base64.b64decode(salt), kind), stored)
    except ValueError:
        return False
