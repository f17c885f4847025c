"""What makes two embedding vectors comparable: the same weights, pooled and normalised the same
way. ``embedding_identity`` spells it ``sha256:<first 16 hex of the weights' sha256>:<pooling>:
<normalisation>``; the edge agent and the cloud's workers load the same GGUF for the same catalogue
model, so the same model has the same identity on both tiers. It goes in an embedding response's
``model`` (``<model id>@<identity>``) and in /v1/models cards as ``meta.embedding``.

Hashing a 0.5-1 GB file takes about a second: the digest is kept in a sidecar file under
``$CASCADE_HOME/cache/sha256/`` keyed by the path, size and mtime, so a file is read once."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from cascade import errors

NORMALISATION = "l2"
WEIGHT_SUFFIXES = (".gguf", ".safetensors", ".bin")  # what counts as weights in a model directory


def embedding_identity(weights: str | Path, pooling: str, home: Path | None = None) -> str:
    """The identity of embeddings computed from the weights at ``weights`` (a file, or an HF
    directory: its weight files) with ``pooling`` ("mean", "cls", "last") and L2 normalisation."""
    return f"sha256:{weights_sha256(weights, home)[:16]}:{pooling}:{NORMALISATION}"


def served_name(model_id: str, identity: str) -> str:
    """An embedding response's ``model``: the model id and, when known, its embedding identity."""
    return f"{model_id}@{identity}" if identity else model_id


def weights_sha256(path: str | Path, home: Path | None = None) -> str:
    """sha256 (hex) of a weights file, or of a directory's weight files in name order; computed
    once per (path, size, mtime) and kept in a sidecar file."""
    path = Path(path).resolve()
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES)
    if not files:
        raise ValueError(f"{path}: no weight files")
    stats = [f.stat() for f in files]
    stamp = f"{path}\0{sum(s.st_size for s in stats)}\0{max(s.st_mtime_ns for s in stats)}"
    sidecar = _cache_dir(home) / (hashlib.sha256(stamp.encode()).hexdigest()[:32] + ".txt")
    try:
        known = sidecar.read_text().strip()
        if len(known) == 64:
            return known
    except OSError:
        pass
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 22):
                h.update(chunk)
    digest = h.hexdigest()
    try:
        sidecar.parent.mkdir(parents=True, exist_ok=True)
        tmp = sidecar.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, sidecar)
    except OSError:  # a read-only home: hashed again next start, nothing else changes
        pass
    return digest


def _cache_dir(home: Path | None) -> Path:
    if home is None:
        from cascade.config import cascade_home

        home = cascade_home()
    return Path(home) / "cache" / "sha256"


def identity_of_card(card: object) -> str:
    """A /v1/models card's ``meta.embedding`` ("" when it states none), from a body that may hold anything."""
    meta = card.get("meta") if isinstance(card, dict) else None
    value = meta.get("embedding") if isinstance(meta, dict) else None
    return value if isinstance(value, str) and 0 < len(value) <= 256 else ""


def cloud_mismatch(local: str, cloud: str, cloud_model: str) -> errors.APIError | None:
    """The refusal (409) of an embedding request sent to the cloud when the cloud's model does not
    compute the same embeddings as this one (vectors of two models are not comparable); None when
    it does."""
    if local and cloud == local:
        return None
    if not local:
        why = "this device's embedding identity is unknown"
    elif not cloud:
        why = f"the cloud states no embedding identity for {cloud_model!r}"
    else:
        why = f"the cloud's model {cloud_model!r} computes embeddings {cloud}, this device's model {local}"
    return errors.APIError(409, f"Cannot embed in the cloud: {why}; its vectors would not be comparable with "
                           "this device's. Send the request without cascade mode \"cloud\".",
                           "invalid_request_error", "cascade", "embedding_model_mismatch")
