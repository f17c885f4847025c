"""What a device keeps on disk of the versions it was given: ``models/<sha256>`` (an ONNX
version's tar unpacked beside it into ``<sha256>.d``) and ``active.json``, the manifest of the
version switched to last, checked whole before an agent serves it again at start."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path

from model_distribution.artifacts.onnx_model import unpack_onnx_tar
from model_distribution.registry.store import file_sha256

log = logging.getLogger(__name__)


def model_path(models_dir: Path, sha256: str, fmt: str | None) -> Path:
    """What a backend loads for a kept version: the GGUF file itself, or the directory an ONNX
    version's tar unpacked into."""
    return models_dir / (f"{sha256}.d" if fmt == "onnx" else sha256)


def kept(models_dir: Path) -> list[tuple[str, int]]:
    """The versions on disk, oldest (by their artifact's mtime) first: (sha256, bytes, with an
    ONNX version's unpacked directory)."""
    if not models_dir.is_dir():
        return []
    out = []
    for p in models_dir.iterdir():
        if len(p.name) == 64 and p.is_file():
            unpacked = models_dir / f"{p.name}.d"
            extra = sum(f.stat().st_size for f in unpacked.rglob("*") if f.is_file()) if unpacked.is_dir() else 0
            out.append((p.stat().st_mtime, p.name, p.stat().st_size + extra))
    return [(sha, size) for _, sha, size in sorted(out)]


def drop(models_dir: Path, sha256: str) -> None:
    """Delete a kept version: its artifact and what it unpacked into."""
    shutil.rmtree(models_dir / f"{sha256}.d", ignore_errors=True)
    (models_dir / sha256).unlink(missing_ok=True)


def installed(state_dir: Path) -> dict | None:
    """The manifest of the version this device switched to last, if its file is still there whole
    (its size and sha256 as signed); None otherwise (then the agent serves its configured model).
    An ONNX version whose unpacked directory is gone is unpacked again from its checked tar."""
    try:
        active = json.loads((state_dir / "active.json").read_text())
        path = state_dir / "models" / active["sha256"]
        if path.stat().st_size != active["size"]:
            raise ValueError(f"{path} is {path.stat().st_size} bytes, not {active['size']}")
        if file_sha256(path)[0] != active["sha256"]:
            raise ValueError(f"{path} does not match its sha256")
        if active.get("format") == "onnx":
            unpack_onnx_tar(path, model_path(path.parent, path.name, "onnx"))
        return active
    except FileNotFoundError:
        return None
    except (ValueError, KeyError, TypeError, OSError) as e:
        log.error("the installed version is unusable, serving the configured model: %s", e)
        return None


def write_synced(path: Path, data: bytes) -> None:
    """``data`` in ``path``, on the disk before it returns (a power cut keeps it or the old file)."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def available_memory() -> int:
    """MemAvailable of /proc/meminfo in bytes (0 where there is none: no check)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0
