"""The fleet's devices, their groups and their desired state, in the registry's database
(portable SQL), and the desired-state document the control plane signs for each device.

Enrolment makes a device's credentials (shown once; only a salted scrypt hash is kept). Setting
the desired state (``cascade fleet assign``, and later the rollout controller) bumps the
device's desired revision; the signed document carries it, so a device applies a document only
when its revision is newer than the last one it applied (no replay of an older assignment).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from model_distribution.registry import Manifest, RegistryError

DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS devices (
        device_id VARCHAR(64) PRIMARY KEY,
        fleet VARCHAR(64) NOT NULL,
        secret_hash VARCHAR(200) NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        desired_name VARCHAR(64),
        desired_version VARCHAR(64),
        desired_rev INTEGER NOT NULL DEFAULT 0,
        reported TEXT,
        last_seen DOUBLE PRECISION
    )""",
    """CREATE TABLE IF NOT EXISTS device_groups (
        device_id VARCHAR(64) NOT NULL,
        group_name VARCHAR(64) NOT NULL,
        PRIMARY KEY (device_id, group_name)
    )""",
)


@dataclass
class Device:
    device_id: str
    fleet: str
    groups: list[str] = field(default_factory=list)
    desired: str | None = None  # name@version
    desired_rev: int = 0
    reported: dict | None = None
    last_seen: float | None = None
    created_at: float = 0.0

    def to_dict(self) -> dict:
        return {"device": self.device_id, "fleet": self.fleet, "groups": self.groups, "desired": self.desired,
                "desired_rev": self.desired_rev, "reported": self.reported, "last_seen": self.last_seen,
                "created_at": self.created_at}


def _hash_secret(secret: str, salt: bytes | None = None) -> str:
    salt = salt or secrets.token_bytes(16)
    digest = hashlib.scrypt(secret.encode(), salt=salt, n=2**14, r=8, p=1, dklen=32)
    return f"scrypt${base64.b64encode(salt).decode()}${base64.b64encode(digest).decode()}"


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
    pw_path.write_text("\n".join(passwd) + "\n")
    os.chmod(pw_path, 0o600)
    acl_path.write_text("\n".join(acl))
    return pw_path, acl_path


def check_secret(secret: str, stored: str) -> bool:
    try:
        _, salt, _ = stored.split("$")
        return hmac.compare_digest(_hash_secret(secret, base64.b64decode(salt)), stored)
    except ValueError:
        return False


def _locked(method):
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


class DeviceStore:
    def __init__(self, root: Path | str):
        Path(root).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(Path(root) / "registry.db", isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        for ddl in SCHEMA:
            self._db.execute(ddl)
        self._lock = threading.RLock()  # one connection, used by the CLI, the server and paho's thread
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(devices)")}
        if "broker_hash" not in columns:  # stores made before broker credentials existed
            self._db.execute("ALTER TABLE devices ADD COLUMN broker_hash VARCHAR(200)")

    def close(self) -> None:
        self._db.close()

    def report(self, device_id: str, reported: dict) -> None:
        """What the device says it runs (its retained reported state)."""
        if not isinstance(reported, dict):
            raise ValueError("reported state must be a JSON object")
        with self._lock:
            self._db.execute("UPDATE devices SET reported = ?, last_seen = ? WHERE device_id = ?",
                             (json.dumps(reported)[:65536], time.time(), device_id))

    def seen(self, device_id: str, status: str) -> None:
        with self._lock:
            self._db.execute("UPDATE devices SET last_seen = ? WHERE device_id = ?", (time.time(), device_id))

    @_locked
    def add(self, device_id: str, groups: list[str], fleet: str = "default") -> str:
        """Enrol a device; returns its secret (shown once). RegistryError for a bad or taken id."""
        for what, value in [("device id", device_id), ("fleet", fleet), *(("group", g) for g in groups)]:
            if not DEVICE.fullmatch(value or ""):
                raise RegistryError(f"{what} {value!r} must be 1-64 characters of [A-Za-z0-9._-]")
        secret = secrets.token_urlsafe(24)
        try:
            self._db.execute("BEGIN")
            self._db.execute("INSERT INTO devices (device_id, fleet, secret_hash, broker_hash, created_at) "
                             "VALUES (?, ?, ?, ?, ?)",
                             (device_id, fleet, _hash_secret(secret), mosquitto_hash(secret), time.time()))
            self._db.executemany("INSERT INTO device_groups (device_id, group_name) VALUES (?, ?)",
                                 [(device_id, g) for g in dict.fromkeys(groups)])
            self._db.execute("COMMIT")
        except sqlite3.IntegrityError as e:
            self._db.execute("ROLLBACK")
            raise RegistryError(f"device {device_id!r} is enrolled already") from e
        return secret

    @_locked
    def broker_entries(self) -> list[tuple[str, str, str]]:
        """(device, fleet, mosquitto password hash) of every device enrolled with broker credentials."""
        return self._db.execute("SELECT device_id, fleet, broker_hash FROM devices WHERE broker_hash IS NOT NULL "
                                "ORDER BY device_id").fetchall()

    @_locked
    def authenticate(self, device_id: str, secret: str) -> bool:
        row = self._db.execute("SELECT secret_hash FROM devices WHERE device_id = ?", (device_id,)).fetchone()
        return row is not None and check_secret(secret, row[0])

    def get(self, device_id: str) -> Device | None:
        found = self.list(device_ids=[device_id])
        return found[0] if found else None

    @_locked
    def list(self, group: str | None = None, device_ids: list[str] | None = None) -> list[Device]:
        sql = ("SELECT device_id, fleet, desired_name, desired_version, desired_rev, reported, last_seen, created_at "
               "FROM devices")
        args: list = []
        if group is not None:
            sql += " WHERE device_id IN (SELECT device_id FROM device_groups WHERE group_name = ?)"
            args.append(group)
        elif device_ids is not None:
            sql += f" WHERE device_id IN ({', '.join('?' * len(device_ids))})"
            args += device_ids
        groups: dict[str, list[str]] = {}
        for d, g in self._db.execute("SELECT device_id, group_name FROM device_groups ORDER BY group_name"):
            groups.setdefault(d, []).append(g)
        out = []
        for d, fleet, name, version, rev, reported, seen, created in self._db.execute(sql + " ORDER BY device_id",
                                                                                       args):
            out.append(Device(d, fleet, groups.get(d, []), f"{name}@{version}" if name else None, rev,
                              json.loads(reported) if reported else None, seen, created))
        return out

    @_locked
    def assign(self, manifest: Manifest, device_id: str | None = None, group: str | None = None) -> list[Device]:
        """Set the desired version of one device or of every device of a group (a new revision each).
        RegistryError when nothing matches."""
        targets = self.list(group=group) if group is not None else self.list(device_ids=[device_id])
        if not targets:
            raise RegistryError(f"no device {device_id!r} enrolled" if group is None
                                else f"no device in group {group!r}")
        self._db.execute("BEGIN")
        self._db.executemany("UPDATE devices SET desired_name = ?, desired_version = ?, desired_rev = desired_rev + 1 "
                             "WHERE device_id = ?", [(manifest.name, manifest.version, d.device_id) for d in targets])
        self._db.execute("COMMIT")
        return self.list(device_ids=[d.device_id for d in targets])


def desired_document(device: Device, manifest: Manifest, signing_key: Ed25519PrivateKey) -> bytes:
    """The signed desired state of ``device`` (what goes, retained, to its desired topic)."""
    payload = {"device": device.device_id, "fleet": device.fleet, "rev": device.desired_rev,
               "model": manifest.name, "version": manifest.version, "sha256": manifest.sha256,
               "size": manifest.size, "format": manifest.format, "issued_at": int(time.time())}
    body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({"payload": base64.b64encode(body).decode(),
                       "signature": base64.b64encode(signing_key.sign(body)).decode()}).encode()


class BadDocument(ValueError):
    """A desired-state message not signed by the control plane, or not for this device."""


def verify_desired(message: bytes, public_key: bytes, device_id: str) -> dict:
    """On a device: the payload of a desired-state message, if the control plane's key signed it
    and it names this device. BadDocument otherwise."""
    try:
        doc = json.loads(message)
        body, signature = base64.b64decode(doc["payload"]), base64.b64decode(doc["signature"])
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, body)
        payload = json.loads(body)
    except (ValueError, KeyError, TypeError, InvalidSignature) as e:
        raise BadDocument(f"desired state refused: not signed by the control plane ({e.__class__.__name__})") from e
    if payload.get("device") != device_id:
        raise BadDocument(f"desired state refused: it is for {payload.get('device')!r}, not {device_id!r}")
    return payload
