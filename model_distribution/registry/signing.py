"""The registry as a TUF repository (python-tuf): root, targets, snapshot and timestamp metadata,
each model version a target (``<name>/<version>``) whose custom field is its manifest. A device
that trusts the root it was provisioned with is then protected against arbitrary artifacts,
rolled-back, frozen and mix-and-match metadata, not only against a corrupted download (its side
is tuf_client.py).

Keys (Ed25519, PEM under ``keys/``, mode 0600): root and targets are the offline keys (keep
copies off the control plane; they sign only at init and on push), snapshot and timestamp the
online ones, and ``desired`` the online key the control plane signs desired-state messages with.

Expiry: root and targets a year, snapshot a week, timestamp a day (the control plane re-signs
the timestamp while it runs). A device offline past the timestamp's expiry keeps serving the
model it verified when it installed it, and installs nothing new until it can fetch fresh
metadata: stale metadata is exactly what a freeze attack would serve.

Writers: a local ``cascade fleet push``, the control plane's pushes and its timestamp re-signing
may run in different processes at once. Every write of the repository holds one lock file,
``<root>/.publish.lock`` (flock: a holder that dies releases it), reads the newest metadata from
disk under it, and replaces each file atomically, so every version is written once and versions
only go up.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import secrets
from pathlib import Path

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from filelock import FileLock, Timeout
from securesystemslib.signer import CryptoSigner, SSlibKey
from tuf.api.metadata import Metadata, MetaFile, Root, Snapshot, TargetFile, Targets, Timestamp
from tuf.api.serialization.json import JSONSerializer

ROLES = ("root", "targets", "snapshot", "timestamp")
KEYS = (*ROLES, "desired")
EXPIRY = {"root": datetime.timedelta(days=365), "targets": datetime.timedelta(days=365),
          "snapshot": datetime.timedelta(days=7), "timestamp": datetime.timedelta(days=1)}
_JSON = JSONSerializer(compact=False)
# A push holds the lock while it hashes and stores the model file (a few GB: tens of seconds);
# waiting longer than this means a writer is stuck, which is worth an error rather than a hang.
LOCK_TIMEOUT_S = 300.0


class SigningError(Exception):
    """The repository or its keys are missing or refused."""


def _expires(role: str) -> datetime.datetime:
    return (datetime.datetime.now(datetime.UTC) + EXPIRY[role]).replace(microsecond=0)


def target_path(name: str, version: str) -> str:
    return f"{name}/{version}"


class Repository:
    """The TUF repository under ``root`` (``$CASCADE_HOME/fleet``): ``tuf/`` (what devices fetch)
    and ``keys/`` (what only the control plane holds). Safe to use from several processes and
    threads at once: each write holds ``writing()``."""

    def __init__(self, root: Path | str, lock_timeout_s: float = LOCK_TIMEOUT_S):
        self.root = Path(root)
        self.metadata_dir = self.root / "tuf"
        self.keys_dir = self.root / "keys"
        self.lock_file = self.root / ".publish.lock"
        self.lock_timeout_s = lock_timeout_s
        self._lock = FileLock(self.lock_file)  # per thread, re-entrant within one

    @contextlib.contextmanager
    def writing(self):
        """Hold the repository's cross-process write lock (re-entrant: a push holds it around its
        registry insert and ``add_target``). SigningError when another writer holds it past the
        timeout."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            self._lock.acquire(timeout=self.lock_timeout_s)
        except Timeout:
            raise SigningError(f"another writer has held {self.lock_file} for {self.lock_timeout_s:g} s (a push or "
                               "the control plane re-signing the timestamp): try again") from None
        try:
            yield
        finally:
            self._lock.release()

    @property
    def initialized(self) -> bool:
        return (self.metadata_dir / "1.root.json").exists() and all(
            (self.keys_dir / f"{k}.pem").exists() for k in KEYS)

    def init(self) -> None:
        """Make the keys and version 1 of every role. SigningError if there are keys already."""
        with self.writing():
            if any((self.keys_dir / f"{k}.pem").exists() for k in KEYS):
                raise SigningError(f"signing keys exist already under {self.keys_dir}")
            self.keys_dir.mkdir(parents=True, exist_ok=True)
            self.metadata_dir.mkdir(parents=True, exist_ok=True)
            os.chmod(self.keys_dir, 0o700)
            signers = {k: self._new_key(k) for k in KEYS}
            root = Root(expires=_expires("root"), consistent_snapshot=True)
            for role in ROLES:
                root.add_key(signers[role].public_key, role)
            self._write(Metadata(root), signers["root"])
            self._write(Metadata(Targets(expires=_expires("targets"))), signers["targets"])
            self._resign_snapshot(signers)
            _replace(self.desired_key_file, (self.desired_public_key().hex() + "\n").encode())

    @property
    def desired_key_file(self) -> Path:
        """The desired-state public key as hex: what a device is provisioned with beside 1.root.json."""
        return self.keys_dir / "desired.pub"

    def root_bytes(self) -> bytes:
        """The root a device is provisioned with (its trust anchor)."""
        return (self.metadata_dir / "1.root.json").read_bytes()

    def desired_key(self) -> Ed25519PrivateKey:
        """The online key desired-state messages are signed with."""
        try:
            return serialization.load_pem_private_key((self.keys_dir / "desired.pem").read_bytes(), password=None)
        except FileNotFoundError as e:
            raise SigningError(f"no desired key under {self.keys_dir}: run cascade fleet keys init") from e

    def desired_public_key(self) -> bytes:
        """The raw Ed25519 public key a device checks desired-state messages with."""
        return self.desired_key().public_key().public_bytes(serialization.Encoding.Raw,
                                                            serialization.PublicFormat.Raw)

    def signer(self, key: str) -> CryptoSigner:
        path = self.keys_dir / f"{key}.pem"
        try:
            private = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except FileNotFoundError as e:
            raise SigningError(f"no {key} key under {self.keys_dir}: run cascade fleet keys init") from e
        return CryptoSigner(private, SSlibKey.from_crypto(private.public_key()))

    def has_target(self, name: str, version: str) -> bool:
        return target_path(name, version) in self._load("targets").signed.targets

    def add_target(self, name: str, version: str, sha256: str, size: int, manifest: dict) -> None:
        """Publish a model version: a new targets version listing it, then snapshot and timestamp."""
        if not self.initialized:
            raise SigningError(f"no signing keys under {self.keys_dir}: run cascade fleet keys init")
        signers = {k: self.signer(k) for k in ("targets", "snapshot", "timestamp")}
        with self.writing():
            targets = self._load("targets")
            path = target_path(name, version)
            targets.signed.targets[path] = TargetFile(size, {"sha256": sha256}, path,
                                                      unrecognized_fields={"custom": {"manifest": manifest}})
            targets.signed.version += 1
            targets.signed.expires = _expires("targets")
            self._write(targets, signers["targets"])
            self._resign_snapshot(signers)

    def refresh_timestamp(self) -> None:
        """Re-sign the timestamp (a new version, a new expiry): what keeps devices updating."""
        signer = self.signer("timestamp")
        with self.writing():
            ts = self._load("timestamp")
            ts.signed.version += 1
            ts.signed.expires = _expires("timestamp")
            self._write(ts, signer)

    # -- files -----------------------------------------------------------------------------

    def _new_key(self, key: str) -> CryptoSigner:
        private = Ed25519PrivateKey.generate()
        path = self.keys_dir / f"{key}.pem"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
        return CryptoSigner(private, SSlibKey.from_crypto(private.public_key()))

    def _file(self, role: str, version: int | None = None) -> Path:
        if role == "timestamp":
            return self.metadata_dir / "timestamp.json"
        return self.metadata_dir / f"{version}.{role}.json"

    def _load(self, role: str) -> Metadata:
        """The newest ``role`` metadata on disk (read afresh each time: another process may have
        written a newer version since)."""
        if role == "timestamp":
            if not self._file(role).exists():
                raise SigningError(f"no timestamp metadata under {self.metadata_dir}")
            return Metadata.from_file(str(self._file(role)))
        versions = sorted(int(p.name.split(".")[0]) for p in self.metadata_dir.glob(f"*.{role}.json"))
        if not versions:
            raise SigningError(f"no {role} metadata under {self.metadata_dir}")
        return Metadata.from_file(str(self._file(role, versions[-1])))

    def _write(self, md: Metadata, signer: CryptoSigner) -> None:
        md.signatures.clear()
        md.sign(signer)
        role = md.signed.type
        _replace(self._file(role, md.signed.version), md.to_bytes(_JSON))

    def _resign_snapshot(self, signers: dict[str, CryptoSigner]) -> None:
        """A new snapshot naming the newest targets, and a new timestamp naming it (under ``writing()``)."""
        targets = self._load("targets")
        try:
            snapshot = self._load("snapshot")
            snapshot.signed.version += 1
        except SigningError:
            snapshot = Metadata(Snapshot(expires=_expires("snapshot")))
        snapshot.signed.meta["targets.json"] = MetaFile(version=targets.signed.version)
        snapshot.signed.expires = _expires("snapshot")
        self._write(snapshot, signers["snapshot"])
        try:
            timestamp = self._load("timestamp")
            timestamp.signed.version += 1
        except SigningError:
            timestamp = Metadata(Timestamp(expires=_expires("timestamp")))
        timestamp.signed.snapshot_meta = MetaFile(version=snapshot.signed.version)
        timestamp.signed.expires = _expires("timestamp")
        self._write(timestamp, signers["timestamp"])


def _replace(path: Path, data: bytes) -> None:
    """Write ``path`` atomically: a temp file of this writer's own (pid and random), fsynced, then
    renamed over ``path``; a reader sees the old file or the new one, never a torn one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    if hasattr(os, "O_DIRECTORY"):  # the rename itself survives a power cut
        fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
