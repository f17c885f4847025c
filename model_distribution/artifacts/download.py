"""A device's download of one artifact: resumable with HTTP Range (python-tuf's own download
has no resume), then checked against the signed TUF target info (length and sha256) before it
is used. The bytes so far live in ``<dest>.part``; a kill -9 resumes from them, and so does the
next try after a full disk (``DiskError``: what the disk took before it refused more is a prefix of
the artifact; after any other disk error, a failed fsync included, they are not trusted and dropped)."""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable
from pathlib import Path

import httpx
from tuf.api.exceptions import LengthOrHashMismatchError
from tuf.api.metadata import TargetFile

_CHUNK = 1 << 20


class DownloadError(Exception):
    """The artifact could not be fetched or did not verify; the message says why."""


class ArtifactMismatch(DownloadError):
    """The bytes served are not the signed target's (deleted: trying again fetches them again)."""


class DiskError(DownloadError):
    """The artifact could not be written here (a full disk, a quota, a read-only or failing one):
    worth trying again once the disk is fixed; the message names the cause first."""


_FULL = (errno.ENOSPC, errno.EDQUOT)  # the disk refused more bytes: those it took are whole


def disk_cause(e: OSError) -> str:
    """What went wrong, as a reason starts: "no space left on device", "read-only file system"."""
    return (e.strerror or str(e) or type(e).__name__).lower()


def fetch(url: str, dest: Path | str, info: TargetFile, client: httpx.Client | None = None,
          progress: Callable[[int, int], None] | None = None, auth: tuple[str, str] | None = None) -> Path:
    """Download ``url`` to ``dest`` (resuming ``dest.part``), verify it against ``info``, and
    move it into place. ``progress(done, total)`` after each chunk; ``auth``: the device's
    ``(device_id, secret)``, sent as HTTP Basic. DownloadError otherwise: ArtifactMismatch for bytes
    that fail verification (deleted: the next try starts over), DiskError when the disk fails."""
    dest = Path(dest)
    part = dest.with_name(dest.name + ".part")
    own = client is None
    client = client or httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0), follow_redirects=True)
    try:
        dest.parent.mkdir(parents=True, exist_ok=True)
        if dest.exists() and not part.exists():  # verified before but never moved on (a full disk): check it again
            os.replace(dest, part)
        have = part.stat().st_size if part.exists() else 0
        if have > info.length:  # cannot be ours
            part.unlink()
            have = 0
        if have < info.length:
            _get(client, url, part, have, info.length, progress, auth)
        with open(part, "rb") as f:
            try:
                info.verify_length_and_hashes(f)
            except LengthOrHashMismatchError as e:
                part.unlink()
                raise ArtifactMismatch(f"{url} does not match its signed target: {e}") from e
        os.replace(part, dest)
        return dest
    except OSError as e:
        kept = 0
        with contextlib.suppress(OSError):
            kept = part.stat().st_size
        then = f"{kept} bytes kept: the next try resumes" if kept else "the next try starts over"
        raise DiskError(f"{disk_cause(e)}: downloading {url} to {part} ({then})") from e
    finally:
        if own:
            client.close()


def _get(client: httpx.Client, url: str, part: Path, have: int, total: int,
         progress: Callable[[int, int], None] | None, auth: tuple[str, str] | None) -> None:
    headers = {"Range": f"bytes={have}-"} if have else {}
    try:
        with client.stream("GET", url, headers=headers, auth=auth) as r:
            if r.status_code == 200 and have:  # the server ignored the range: start over
                have = 0
            elif r.status_code not in (200, 206):
                raise DownloadError(f"GET {url}: HTTP {r.status_code}")
            syncing = False
            try:
                with open(part, "r+b" if have else "wb") as f:
                    f.seek(have)
                    f.truncate()
                    for chunk in r.iter_bytes(_CHUNK):
                        if have + len(chunk) > total:
                            raise DownloadError(f"{url} is longer than its signed length {total}")
                        f.write(chunk)
                        have += len(chunk)
                        if progress is not None:
                            progress(have, total)
                    f.flush()
                    syncing = True
                    os.fsync(f.fileno())
            except OSError as e:
                if syncing or e.errno not in _FULL:  # what reached the disk is not known: start over
                    with contextlib.suppress(OSError):
                        part.unlink()
                raise
    except httpx.HTTPError as e:
        raise DownloadError(f"GET {url}: {e!r} (the {have} bytes so far are kept; the next try resumes)") from e
