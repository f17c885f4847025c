"""ONNX Runtime GenAI exports as the fleet and the agent see them: a directory (``genai_config.json``,
the model files it names, tokenizer, chat template, and our ``cascade_model.json`` when we built
it) that travels as ONE artifact: a deterministic uncompressed tar of it.

The tar is deterministic (sorted names, mtime 0, uid/gid 0, fixed modes, no links or devices) so
the same directory pushed twice is the same sha256, and the signed digest is the tar's. A device
unpacks it with tarfile's ``data`` filter after refusing any member that is not a plain file or
folder under the root, so a hostile artifact cannot write outside its directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path, PurePosixPath

GENAI_CONFIG = "genai_config.json"
CASCADE_MODEL = "cascade_model.json"  # what cloud_tier/onnx_export.py writes beside the export
_CHUNK = 1 << 20


class OnnxModelError(ValueError):
    """Not a usable ONNX export (or tar of one); the message says why, in one line."""


def describe_onnx_dir(path: Path | str) -> dict:
    """What an export directory holds: format ("onnx"), quantization (int4/fp16/fp32 or "unknown"),
    architecture, context_length, vocab_size, name, target. OnnxModelError when it is not a
    directory, has no (or a broken) genai_config.json, or the model file it names is missing."""
    path = Path(path)
    if not path.is_dir():
        raise OnnxModelError(f"{path} is not a directory (an ONNX export is a directory with {GENAI_CONFIG})")

    def read(name: str) -> bytes | None:
        f = path / name
        return f.read_bytes() if f.is_file() else None

    return _describe(read, str(path), path.name)


def describe_onnx_tar(path: Path | str) -> dict:
    """describe_onnx_dir for the packed artifact (what a push over HTTP uploads), read from its
    members without unpacking; OnnxModelError also when a member is not safe to unpack."""
    path = Path(path)
    try:
        with tarfile.open(path, "r:") as tar:
            members = {m.name: m for m in _safe_members(tar, path)}

            def read(name: str) -> bytes | None:
                m = members.get(name)
                return tar.extractfile(m).read() if m is not None and m.isfile() else None

            return _describe(read, str(path), path.stem)
    except tarfile.TarError as e:
        raise OnnxModelError(f"{path} is not an uncompressed tar of an ONNX export: {e}") from e


def _describe(read: Callable[[str], bytes | None], where: str, default_name: str) -> dict:
    raw = read(GENAI_CONFIG)
    if raw is None:
        raise OnnxModelError(f"{where} has no {GENAI_CONFIG}: not an ONNX Runtime GenAI export "
                             "(make one with cascade models export MODEL --format onnx)")
    try:
        model = json.loads(raw)["model"]
        decoder_file = model["decoder"]["filename"]
        if not isinstance(decoder_file, str) or not decoder_file:
            raise ValueError("decoder.filename is not a file name")
    except (ValueError, KeyError, TypeError) as e:
        raise OnnxModelError(f"{where}/{GENAI_CONFIG} is not a valid genai config: {type(e).__name__}: {e}") from e
    graph = read(decoder_file)
    if graph is None:
        raise OnnxModelError(f"{where} lacks {decoder_file}, the model file its {GENAI_CONFIG} names")
    ours = {}
    if (raw_ours := read(CASCADE_MODEL)) is not None:
        try:
            ours = json.loads(raw_ours)
        except ValueError as e:
            raise OnnxModelError(f"{where}/{CASCADE_MODEL} is not JSON: {e}") from e
        if not isinstance(ours, dict):
            raise OnnxModelError(f"{where}/{CASCADE_MODEL} is not a JSON object")
    # without our manifest: MatMulNBits is how the builder stores int4 weights; fp16 vs fp32 is
    # not written anywhere cheap to read, so "unknown"
    quantization = ours.get("quantization") or ours.get("precision") or (
        "int4" if b"MatMulNBits" in graph else "unknown")
    return {
        "format": "onnx",
        "quantization": str(quantization),
        "architecture": str(ours.get("architecture") or model.get("type") or "unknown"),
        "context_length": _int_or_none(ours.get("context_length") or model.get("context_length")),
        "vocab_size": _int_or_none(model.get("vocab_size")),
        "name": str(ours.get("name") or default_name),
        "target": str(ours.get("target") or _target(model)),
    }


def _target(model: dict) -> str:
    """The provider the builder exported for (its session options name it), "cpu" when none."""
    options = model.get("decoder", {}).get("session_options", {}).get("provider_options") or []
    for entry in options:
        if isinstance(entry, dict) and entry:
            return next(iter(entry))
    return "cpu"


def _int_or_none(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


# -- one artifact --------------------------------------------------------------------------

def _files(root: Path) -> list[tuple[str, Path]]:
    """Every file under ``root`` as (posix name, path), sorted; links and devices refused."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            if p.is_symlink() or not (p.is_file() or p.is_dir()):
                raise OnnxModelError(f"{p} is a link or a special file: an export holds plain files only")
        for name in filenames:
            p = Path(dirpath) / name
            out.append((p.relative_to(root).as_posix(), p))
    return sorted(out)


def pack_onnx_dir(src: Path | str, dest: Path | str) -> tuple[str, int]:
    """Write the export ``src`` as a deterministic tar to ``dest``; its sha256 (hex) and size.
    Only files are stored (folders are implied by the names), each with mode 0644, mtime 0,
    uid/gid 0 and no owner names, in sorted order: the same files give the same bytes."""
    src = Path(src)
    describe_onnx_dir(src)  # refuse what is not an export before writing anything
    h, n = hashlib.sha256(), 0

    class _Hashing:
        def write(self, b):
            nonlocal n
            h.update(b)
            n += len(b)
            return out.write(b)

    with open(dest, "wb") as out, tarfile.open(fileobj=_Hashing(), mode="w|", format=tarfile.PAX_FORMAT) as tar:
        for name, p in _files(src):
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = p.stat().st_size, 0o644, 0
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(p, "rb") as f:
                tar.addfile(info, f)
    return h.hexdigest(), n


def _safe_members(tar: tarfile.TarFile, where: Path) -> list[tarfile.TarInfo]:
    """The members, each a plain file or folder with a relative name inside the root."""
    members = tar.getmembers()
    for m in members:
        name = PurePosixPath(m.name)
        if name.is_absolute() or ".." in name.parts or "\\" in m.name or not m.name:
            raise OnnxModelError(f"{where}: member {m.name!r} would land outside the model directory")
        if not (m.isfile() or m.isdir()):
            raise OnnxModelError(f"{where}: member {m.name!r} is a link or a special file")
    return members


def unpack_onnx_tar(path: Path | str, dest: Path | str) -> Path:
    """Unpack the artifact into the directory ``dest`` (atomically: a temp folder beside it,
    checked to be an export, then renamed); ``dest`` as it is when it exists already (its name
    is the artifact's digest, so it holds these bytes). OnnxModelError for an unsafe member or a
    tar that is not an export."""
    path, dest = Path(path), Path(dest)
    if dest.is_dir():
        return dest
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        with tarfile.open(path, "r:") as tar:
            members = _safe_members(tar, path)
            tar.extractall(tmp, members=members, filter="data")
        describe_onnx_dir(tmp)
        os.replace(tmp, dest)
    except tarfile.TarError as e:
        raise OnnxModelError(f"{path} is not an uncompressed tar of an ONNX export: {e}") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest
