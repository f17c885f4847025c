"""The fleet's model registry: published model versions and their artifacts.

Versions live in SQLite (portable SQL: plain tables, no SQLite-only types or upserts), artifacts
on disk addressed by their sha256 (``artifacts/sha256/<hex>``), so one file pushed under two
names is stored once and a device can fetch it by digest from any mirror. A published
``name@version`` is immutable: pushing other bytes under it is refused, the same bytes again is
a no-op. A file that is not a valid model of its format is refused with the reason. An ONNX
Runtime GenAI export is a directory: it is pushed as one artifact, a deterministic tar of it
(model_distribution/artifacts/onnx_model.py), whose sha256 is what devices verify. The
manifest carries the ``[cascade]`` thresholds calibrated for that model, so the escalation
policy travels with the model it was calibrated for.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import sqlite3
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from cascade.calibration import CalibrationError, check_calibration
from model_distribution.artifacts.gguf_meta import GGUFError, validate_gguf
from model_distribution.artifacts.onnx_model import OnnxModelError, describe_onnx_tar, pack_onnx_dir
from sync.sqlite import connect

NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
# semver 2.0.0 (semver.org), without build metadata: it does not order versions
SEMVER = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-((?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*)"
                    r"(?:\.(?:0|[1-9]\d*|\d*[A-Za-z-][0-9A-Za-z-]*))*))?")
FORMATS = ("gguf", "onnx")
_CHUNK = 1 << 20

SCHEMA = """
CREATE TABLE IF NOT EXISTS model_versions (
    name VARCHAR(64) NOT NULL,
    version VARCHAR(64) NOT NULL,
    format VARCHAR(16) NOT NULL,
    quantization VARCHAR(32) NOT NULL,
    architecture VARCHAR(64) NOT NULL,
    context_length INTEGER,
    size BIGINT NOT NULL,
    sha256 CHAR(64) NOT NULL,
    min_agent_version VARCHAR(64),
    calibration TEXT NOT NULL,
    pushed_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (name, version)
)
"""


class RegistryError(ValueError):
    """A push or a lookup the registry refuses; the message says why."""


class ImmutableVersion(RegistryError):
    """Other bytes pushed under a published name@version (the control plane answers 409)."""


def parse_semver(version: str) -> tuple:
    """A sort key for a semver string (a prerelease sorts before its release); RegistryError if not semver."""
    m = SEMVER.fullmatch(version or "")
    if m is None:
        raise RegistryError(f"version {version!r} is not a semantic version (MAJOR.MINOR.PATCH[-PRERELEASE])")
    major, minor, patch, pre = m.groups()
    pre_key = (1,) if pre is None else (0, *((0, int(p)) if p.isdigit() else (1, p) for p in pre.split(".")))
    return int(major), int(minor), int(patch), pre_key


def check_names(name: str, version: str, min_agent_version: str | None = None) -> None:
    """RegistryError for a bad model name, version or minimum agent version (cheap: the control
    plane checks them before a model file is uploaded)."""
    if not NAME.fullmatch(name or ""):
        raise RegistryError(f"model name {str(name)[:80]!r} must be 1-64 characters of [a-z0-9._-], starting with a "
                            "letter or digit")
    for what, v in (("version", version), ("minimum agent version", min_agent_version)):
        if v is not None and len(v) > 64:
            raise RegistryError(f"{what} {v[:40]!r}... is {len(v)} characters: at most 64")
    parse_semver(version)
    if min_agent_version is not None:
        parse_semver(min_agent_version)


@dataclass(frozen=True)
class Manifest:
    """One published model version: what a device needs to decide, fetch and verify it."""

    name: str
    version: str
    format: str
    quantization: str
    architecture: str
    context_length: int | None
    size: int
    sha256: str
    min_agent_version: str | None = None
    calibration: dict = field(default_factory=dict)  # the [cascade] thresholds for this model
    pushed_at: float = 0.0

    @property
    def ref(self) -> str:
        return f"{self.name}@{self.version}"

    def to_dict(self) -> dict:
        return asdict(self)

    def signable(self) -> dict:
        """The manifest as TUF's canonical JSON takes it (no floats): the time in whole seconds,
        the thresholds as a JSON string."""
        return {**asdict(self), "pushed_at": int(self.pushed_at),
                "calibration": json.dumps(self.calibration, sort_keys=True)}


class Registry:
    """The registry under ``root`` (``$CASCADE_HOME/fleet`` by default): ``registry.db`` and ``artifacts/``."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        self.artifacts = self.root / "artifacts" / "sha256"
        self.artifacts.mkdir(parents=True, exist_ok=True)
        self._db = connect(self.root / "registry.db", timeout_s=5.0)
        self._db.execute(SCHEMA)

    def close(self) -> None:
        self._db.close()

    def artifact_path(self, sha256: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", sha256 or ""):
            raise RegistryError(f"{sha256!r} is not a sha256 digest")
        return self.artifacts / sha256

    # -- push ------------------------------------------------------------------------------

    def push(self, path: Path | str, name: str, version: str, calibration: Path | str | dict | None = None,
             min_agent_version: str | None = None) -> tuple[Manifest, bool]:
        """Publish ``path`` (a GGUF file, an ONNX export directory or the tar of one) as
        ``name@version``. Returns the manifest and whether it was new (False: the same bytes were
        already published under it). ``calibration``: an edge.toml, or its ``[cascade]`` table
        itself (what a push over HTTP sends). RegistryError for a bad name, version or file;
        ImmutableVersion for other bytes under a published name@version."""
        path = Path(path)
        check_names(name, version, min_agent_version)
        if path.is_dir():
            packed = self.artifacts / f".pack-{os.getpid()}-{time.monotonic_ns()}.tar"
            try:
                pack_onnx_dir(path, packed)  # refuses what is not an export, with the reason
                return self.push(packed, name, version, calibration, min_agent_version)
            except OnnxModelError as e:
                raise RegistryError(str(e)) from e
            finally:
                packed.unlink(missing_ok=True)
        if not path.is_file():
            raise RegistryError(f"{path} is not a file (nor an ONNX export directory)")
        meta = _describe(path)
        try:  # checked as a device will apply it, so no version ships a calibration a device cannot use
            if isinstance(calibration, dict):  # over HTTP: the model itself, never a path
                thresholds = check_calibration(calibration)
            elif calibration is not None:
                thresholds = check_calibration(read_calibration(calibration), Path(calibration).expanduser().parent)
            else:
                thresholds = {}
        except CalibrationError as e:
            raise RegistryError(str(e)) from None
        digest, size = file_sha256(path)
        existing = self.get(name, version)
        if existing is not None:
            if existing.sha256 != digest:
                raise ImmutableVersion(f"{name}@{version} is published already with other bytes (sha256 "
                                       f"{existing.sha256[:12]}...): a published version is immutable; push a "
                                       "new version")
            return existing, False
        manifest = Manifest(name, version, meta["format"], meta["quantization"], meta["architecture"],
                            meta["context_length"], size, digest, min_agent_version, thresholds, time.time())
        _check_signable(manifest, path)  # before anything is kept: never a version listed that cannot be signed
        self._store(path, digest)
        try:
            self._db.execute(
                "INSERT INTO model_versions (name, version, format, quantization, architecture, context_length, "
                "size, sha256, min_agent_version, calibration, pushed_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (manifest.name, manifest.version, manifest.format, manifest.quantization, manifest.architecture,
                 manifest.context_length, manifest.size, manifest.sha256, manifest.min_agent_version,
                 json.dumps(thresholds, sort_keys=True), manifest.pushed_at))
        except sqlite3.IntegrityError:  # pushed by another process meanwhile: judge against that one
            return self.push(path, name, version, calibration, min_agent_version)
        return manifest, True

    def _store(self, path: Path, digest: str) -> None:
        target = self.artifact_path(digest)
        if target.exists():
            return
        tmp = target.with_name(f".{digest}.{os.getpid()}.tmp")
        shutil.copyfile(path, tmp)
        if file_sha256(tmp)[0] != digest:  # the source changed while it was read
            tmp.unlink()
            raise RegistryError(f"{path} changed while it was being pushed")
        os.replace(tmp, target)

    def forget(self, name: str, version: str) -> None:
        """Take back a version this process has just inserted and could not sign (never one a device
        may have seen: the signature is what makes it published)."""
        self._db.execute("DELETE FROM model_versions WHERE name = ? AND version = ?", (name, version))

    # -- read ------------------------------------------------------------------------------

    def get(self, name: str, version: str) -> Manifest | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM model_versions WHERE name = ? AND version = ?",
                               (name, version)).fetchone()
        return None if row is None else _manifest(row)

    def resolve(self, ref: str) -> Manifest:
        """``name@version`` -> its manifest; RegistryError when it is not published."""
        name, sep, version = ref.partition("@")
        if not sep or not name or not version:
            raise RegistryError(f"{ref!r} is not name@version")
        m = self.get(name, version)
        if m is None:
            raise RegistryError(f"{ref} is not published (see cascade fleet models)")
        return m

    def models(self, name: str | None = None) -> list[Manifest]:
        """Every published version, by name, newest version first."""
        sql, args = f"SELECT {_COLUMNS} FROM model_versions", ()
        if name is not None:
            sql, args = sql + " WHERE name = ?", (name,)
        out = [_manifest(r) for r in self._db.execute(sql, args).fetchall()]
        out.sort(key=lambda m: parse_semver(m.version), reverse=True)
        out.sort(key=lambda m: m.name)  # stable: newest first within a name
        return out


_COLUMNS = ("name, version, format, quantization, architecture, context_length, size, sha256, min_agent_version, "
            "calibration, pushed_at")


def _manifest(row) -> Manifest:
    *head, calibration, pushed_at = row
    return Manifest(*head, calibration=_finite(json.loads(calibration)), pushed_at=pushed_at)


def _finite(table: dict) -> dict:
    """A stored calibration with an infinity (what versions pushed before calibrations were
    checked may hold: JSON has none) as null, which means the same: that threshold off."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in table.items()} \
        if isinstance(table, dict) else {}


def _describe(path: Path) -> dict:
    """What the file is, from its own header; RegistryError when it is not a model we can serve."""
    with open(path, "rb") as f:
        head = f.read(512)
    if head[257:262] == b"ustar":  # a tar: an ONNX export packed as one artifact
        try:
            d = describe_onnx_tar(path)
        except OnnxModelError as e:
            raise RegistryError(str(e)) from e
        return _check_described({k: d[k] for k in ("format", "quantization", "architecture", "context_length")},
                                path)
    if head[:4] != b"GGUF":
        raise RegistryError(f"{path} is not a model file of a known format ({', '.join(FORMATS)}): it does not "
                            "start with the GGUF magic, nor is it a tar of an ONNX export")
    try:  # the whole file, as llama.cpp's loader will read it: no device gets one it refuses
        meta = validate_gguf(path)
        arch, quant, ctx = meta.architecture, meta.quantization, meta.context_length
    except (GGUFError, KeyError, ValueError, OSError) as e:
        raise RegistryError(f"{path} is not a valid GGUF model: {e}") from e
    return _check_described({"format": "gguf", "quantization": quant, "architecture": arch, "context_length": ctx},
                            path)


_FIELD = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}")
MAX_MANIFEST_BYTES = 16 << 10  # one target's entry in the signed targets, which every device downloads whole


def _check_described(meta: dict, path: Path) -> dict:
    """What a file says of itself, as a manifest may carry it: names of at most 64 characters, a
    context length that is a positive 32-bit integer (a float, NaN or 2**64 in a GGUF header
    crashed the signing and left a version listed but unsigned)."""
    for key in ("architecture", "quantization"):
        value = meta[key]
        if not isinstance(value, str) or not _FIELD.fullmatch(value):
            raise RegistryError(f"{path}: its {key} {str(value)[:40]!r}{'...' if len(str(value)) > 40 else ''} is not "
                                "a name of 1-64 characters of [A-Za-z0-9_.+-]")
    ctx = meta["context_length"]
    if ctx is not None and (not isinstance(ctx, int) or isinstance(ctx, bool) or not 0 < ctx < 2**31):
        raise RegistryError(f"{path}: its context length {str(ctx)[:40]} is not a positive 32-bit integer")
    return meta


def _check_signable(manifest: Manifest, path: Path) -> None:
    """The manifest as TUF will sign it: canonical JSON (no floats), and small: every device
    downloads the whole targets metadata, and its client refuses it past 5 MB."""
    from securesystemslib.formats import encode_canonical

    try:
        size = len(encode_canonical(manifest.signable()))
    except Exception as e:  # securesystemslib's FormatError, whatever it could not encode
        raise RegistryError(f"{path}: its manifest cannot be signed: {e}"[:300]) from None
    if size > MAX_MANIFEST_BYTES:
        raise RegistryError(f"{path}: its manifest is {size} bytes, more than the {MAX_MANIFEST_BYTES} a signed "
                            "target may carry")


def read_calibration(path: Path | str) -> dict:
    """The ``[cascade]`` table of an edge.toml (what ``cascade calibrate`` writes)."""
    try:
        with open(path, "rb") as f:
            table = tomllib.load(f).get("cascade")
    except FileNotFoundError as e:
        raise RegistryError(f"calibration file not found: {path}") from e
    except tomllib.TOMLDecodeError as e:
        raise RegistryError(f"calibration file {path} is not valid TOML: {e}") from e
    if not isinstance(table, dict) or not table:
        raise RegistryError(f"calibration file {path} has no [cascade] section (write one with cascade calibrate)")
    return table


def file_sha256(path: Path) -> tuple[str, int]:
    """A file's sha256 (hex) and size, read in chunks."""
    h, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            n += len(chunk)
    return h.hexdigest(), n
