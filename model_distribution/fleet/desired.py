"""The signed desired-state document: what the control plane tells one device to serve, and how
the device decides whether to believe it.

The control plane signs each device's document with its online ``desired`` key (Ed25519): the
device, its fleet, the desired revision (bumped by every assignment), the version, and
``issued_at``, the control plane's clock when it signed. ``DesiredDocuments`` signs once per
revision and again once the signature is ``RESIGN_S`` old, so the retained MQTT message and the
HTTP fallback are the same bytes and never older than a day while the control plane runs.

A device (``verify_desired``, ``AppliedDesired``) takes a document only when the control plane's
key signed it, it names this device, it is not older than ``MAX_AGE_S`` by the device's clock
(a freeze: an old document held back and sent later), and it is not older than the document it
applied last, which it keeps on disk, so no restart reopens a replay:

    issued before the one applied              refused (a replay)
    a newer revision                           taken
    the same revision, or an older one signed  taken only if signed later than the one applied
      later (the control plane's database         (a restored or restarted control plane); the
      restored)                                   same document again changes nothing
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import secrets
import threading
import time
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from cascade import wire
from model_distribution.fleet.devices import Device
from model_distribution.registry.store import Manifest, Registry

MAX_DOCUMENT_BYTES = 64 << 10
RESIGN_S = 86400.0  # the control plane signs a device's document again once it is this old
MAX_AGE_S = 7 * 86400.0  # a device refuses a document signed longer ago than this


class BadDocument(ValueError):
    """A desired-state message not signed by the control plane, not for this device, too old, or
    older than the one applied (a replay)."""


def desired_document(device: Device, manifest: Manifest, signing_key: Ed25519PrivateKey,
                     prefetch: Manifest | None = None, now: float | None = None) -> bytes:
    """The signed desired state of ``device`` (what goes, retained, to its desired topic): the
    version to serve (inside its window, after its jitter) and one to fetch ahead, if any."""
    payload = {"device": device.device_id, "fleet": device.fleet, "rev": device.desired_rev,
               "model": manifest.name, "version": manifest.version, "sha256": manifest.sha256,
               "size": manifest.size, "format": manifest.format,
               "issued_at": int(time.time() if now is None else now)}
    if device.window:
        payload["window"] = device.window
    if device.jitter_s:
        payload["jitter_s"] = device.jitter_s
    if prefetch is not None and prefetch.sha256 != manifest.sha256:
        payload["prefetch"] = {"model": prefetch.name, "version": prefetch.version, "sha256": prefetch.sha256,
                               "size": prefetch.size, "format": prefetch.format}
    body = json.dumps(payload, sort_keys=True, separators=(",", ":")).encode()
    return json.dumps({"payload": base64.b64encode(body).decode(),
                       "signature": base64.b64encode(signing_key.sign(body)).decode()}).encode()


def verify_desired(message: bytes, public_key: bytes, device_id: str, now: float | None = None,
                   max_age_s: float = MAX_AGE_S) -> dict:
    """On a device: the payload of a desired-state message, if the control plane's key signed it,
    it names this device and it is not older than ``max_age_s``. BadDocument otherwise."""
    try:
        doc = wire.loads(message, limit=MAX_DOCUMENT_BYTES, max_depth=4)
        body = base64.b64decode(doc["payload"], validate=True)
        signature = base64.b64decode(doc["signature"], validate=True)
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, body)
        payload = wire.loads(body, limit=MAX_DOCUMENT_BYTES, max_depth=4)
    except (ValueError, KeyError, TypeError, binascii.Error, InvalidSignature) as e:
        raise BadDocument(f"desired state refused: not signed by the control plane ({e.__class__.__name__})") from e
    if not isinstance(payload, dict):
        raise BadDocument("desired state refused: its payload is not an object")
    if payload.get("device") != device_id:
        raise BadDocument(f"desired state refused: it is for {str(payload.get('device'))[:64]!r}, not {device_id!r}")
    rev, issued = payload.get("rev"), payload.get("issued_at")
    if not isinstance(rev, int) or isinstance(rev, bool) or rev < 0 or not isinstance(issued, int) or \
            isinstance(issued, bool):
        raise BadDocument("desired state refused: no revision or no issued_at")
    age = (time.time() if now is None else now) - issued
    if age > max_age_s:
        raise BadDocument(f"desired state refused: signed {age / 86400:.1f} days ago, more than the "
                          f"{max_age_s / 86400:.0f} a document may be old (held back and sent late?)")
    return payload


class AppliedDesired:
    """The revision and signing time of the last document a device took, kept in ``path`` (None:
    in memory only) so that the order survives a restart. See the module docstring."""

    def __init__(self, path: Path | None = None):
        self.path = path
        self.rev, self.issued_at = -1, -1
        if path is not None and path.is_file():
            try:
                kept = wire.loads(path.read_bytes(), limit=4096)
                self.rev, self.issued_at = int(kept["rev"]), int(kept["issued_at"])
            except (ValueError, KeyError, TypeError) as e:  # torn or edited: start from nothing, and say so
                import logging

                logging.getLogger(__name__).error("%s is unreadable (%s): any document will be taken", path, e)

    def judge(self, payload: dict) -> bool:
        """True for a document newer than the one taken last; False for that one again; BadDocument
        for an older one (a replay)."""
        rev, issued = payload["rev"], payload["issued_at"]
        if issued < self.issued_at or (issued == self.issued_at and rev < self.rev):
            raise BadDocument(f"desired state refused: revision {rev} was signed before revision {self.rev}, "
                              "which this device took already (a replay)")
        return rev != self.rev  # newer; or older but signed later: a control plane whose database was restored

    def take(self, payload: dict) -> None:
        """Remember ``payload`` as the document taken last (written atomically before it is used)."""
        self.rev, self.issued_at = payload["rev"], payload["issued_at"]
        if self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        with open(tmp, "w") as f:
            json.dump({"rev": self.rev, "issued_at": self.issued_at}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)


class DesiredDocuments:
    """Each device's signed desired document, signed once per desired revision (and again once
    it is ``resign_s`` old) and kept, so the retained message (published again at each
    reconnect) and the control plane's HTTP fallback (``GET /v1/devices/{device}/desired``) are
    the same bytes."""

    def __init__(self, signing_key, resign_s: float = RESIGN_S):
        self.key = signing_key
        self.resign_s = resign_s
        self._signed: dict[str, tuple[int, float, bytes]] = {}  # device -> (revision, signed at, document)
        self._lock = threading.Lock()

    def get(self, device: Device, registry: Registry) -> bytes:
        """Its document (RegistryError when its desired version is not published)."""
        return self.signed(device, registry)[1]

    def signed(self, device: Device, registry: Registry) -> tuple[tuple[int, float], bytes]:
        """((revision, signed at), its document): the pair changes whenever the bytes do."""
        with self._lock:
            rev, at, doc = self._signed.get(device.device_id, (-1, 0.0, b""))
            now = time.time()
            if rev != device.desired_rev or now - at >= self.resign_s:
                prefetch = registry.resolve(device.prefetch) if device.prefetch else None
                doc = desired_document(device, registry.resolve(device.desired), self.key, prefetch, now)
                rev, at = device.desired_rev, now
                self._signed[device.device_id] = (rev, at, doc)
            return (rev, at), doc
