"""A device's side of a model version change: from a verified desired-state document to the file
the agent serves, each step reported.

    REJECTED     refused up front, with the reason: a format this agent cannot serve, a minimum
                 agent version above this one, more than the staging disk budget
    DOWNLOADING  resumable, into staging (progress reported)
    VERIFYING    the signed TUF target (length, sha256) of name@version, fetched now
    ACTIVATING   the agent's switch (``activate(path, manifest)``), then
    ACTIVE       or FAILED with the reason; a failure leaves the old model serving

The previous version stays on disk (``models/<sha256>``), so going back needs no download. An
ONNX version's artifact is a tar of its export directory: verified like a GGUF, then unpacked
(safely: plain files under its root only) into ``models/<sha256>.d``, which the backend loads.
``active.json`` names the version switched to last (written atomically once the switch is done),
so an agent that restarts, or was killed mid-switch, comes back on one consistent model:
``installed(state_dir)``; a download killed midway resumes from its ``staging/<sha256>.part``.

``apply`` never raises: whatever fails (the network, a full disk, the switch, a bug) is reported
with a one-line reason, the old model serving; ``retry`` says whether the same document may go
better later (a cut download, a full disk). A window that never opens is REJECTED, not waited for.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import random
import re
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import httpx
from tuf.api import exceptions as tuf_errors

from model_distribution.artifacts.download import ArtifactMismatch, DownloadError, disk_cause, fetch
from model_distribution.artifacts.onnx_model import OnnxModelError, unpack_onnx_tar
from model_distribution.device.models_on_disk import available_memory, drop, installed, kept, model_path, write_synced
from model_distribution.protocol.device_messages import DeviceState
from model_distribution.protocol.windows import in_window, parse_window, seconds_to_window
from model_distribution.registry.store import parse_semver
from model_distribution.registry.tuf_client import manifest_of, verified_target

log = logging.getLogger(__name__)

FORMATS = ("gguf", "onnx")  # what this agent's backends load (onnx: where onnxruntime-genai is installed)
MAX_JITTER_S = 3600.0
REASON_CHARS, TEXT_CHARS = 500, 200  # what a device says: a reason, any other string (the control plane's bounds)
_UNSAFE_TEXT = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")  # the control plane refuses these


@dataclass
class DeviceConfig:
    device: str
    control_plane: str  # http://host:8090: /v1/tuf and /v1/artifacts (or a mirror of both)
    trusted_root: bytes  # the 1.root.json the device was provisioned with
    state_dir: Path  # staging, models and the TUF cache
    agent_version: str = "0.0.0"
    disk_budget_bytes: int = 8 << 30
    keep_versions: int = 2  # the active one and the one before it
    memory_budget_bytes: int = 0  # what a version may take in memory while both load (0: what the OS has available)
    secret: str = ""  # its enrolled secret: HTTP Basic device:secret to the control plane ("": none sent)
    artifact_url: str = ""  # a mirror of /v1/artifacts ("": the control plane's)
    metadata_url: str = ""  # a mirror of /v1/tuf ("": the control plane's)
    # a version fetched ahead (a rollout's next wave) is switched to on the signed metadata it was
    # verified against, if that is this recent; older, the metadata is refreshed first. (At 1,000
    # devices the second refresh, as their wave opened, was most of a wave's time.)
    prefetch_trust_s: float = 600.0

    def auth_for(self, url: str) -> tuple[str, str] | None:
        """The credentials to send to ``url``: only to the control plane itself, never to a
        mirror (a CDN or static store needs none, and must not learn the secret)."""
        same = urlsplit(url)[:2] == urlsplit(self.control_plane)[:2]
        return (self.device, self.secret) if self.secret and same else None


class DeviceUpdater:
    """Turns a desired document into the active model; ``report(state)`` is called at each step
    (the ``DeviceStateClient.report`` of the device)."""

    def __init__(self, config: DeviceConfig, report: Callable[[dict], None],
                 activate: Callable[[Path, dict], None], active: dict | None | bool = True):
        self.config = config
        self.report = report
        self.activate = activate
        self.models_dir = config.state_dir / "models"
        self.staging = config.state_dir / "staging"
        self.active_file = config.state_dir / "active.json"
        # the manifest serving now: found on disk (True), or given by a caller that checked it already
        self.active: dict | None = installed(config.state_dir) if active is True else active or None
        self._lock = threading.Lock()  # one change at a time
        self._prefetched: dict[tuple, tuple[float, object]] = {}  # (model, version, sha256) -> (when, target info)
        self.retry = False  # did the last apply fail in a way worth trying again (a download cut, a full disk)?
        self.wait_s: float | None = None  # WAITING: seconds until its activation window opens
        self._last_base: dict = {}  # the assignment the last report was about (a prefetch reports beside it)
        self._step = ""  # the state reported last (a failure nobody foresaw says where it happened)
        # one client for the metadata and the artifacts: its connections, and one TLS context (loading
        # the CA bundle costs tens of ms of CPU: per request, that is most of a small device's update)
        self.http = httpx.Client(timeout=httpx.Timeout(30.0, connect=10.0), follow_redirects=True)

    def close(self) -> None:
        self.http.close()

    def apply(self, desired: dict) -> str:
        """Go to ``desired`` (a verified payload: model, version, sha256, size, format, rev; and
        optionally window, jitter_s, prefetch); the final state: ACTIVE, FAILED, REJECTED, or
        WAITING (downloaded and verified, for its activation window: ``wait_s`` says how long).
        Never raises: an error nobody foresaw is FAILED with its reason, the old model serving."""
        with self._lock:
            self.retry, self.wait_s, self._step = False, None, ""
            base = {"desired": f"{desired.get('model')}@{desired.get('version')}", "rev": desired.get("rev")}
            try:
                return self._apply(desired, base)
            except Exception as e:
                log.exception("applying %s failed", base["desired"])
                self.retry, self.wait_s = isinstance(e, OSError), None  # a disk may be freed; a bug stays
                where = f" while {self._step.lower()}" if self._step else ""
                return self._fail(base, DeviceState.FAILED,
                                  f"unexpected {type(e).__name__}{where}, the old model still serves: {e}")

    def _apply(self, desired: dict, base: dict) -> str:
        ref = base["desired"]
        if self.active is not None and self.active.get("sha256") == desired.get("sha256"):
            self._say({**base, "state": DeviceState.ACTIVE, "model": ref, "sha256": desired["sha256"]})
            self._prefetch(desired.get("prefetch"), desired.get("jitter_s"))
            return DeviceState.ACTIVE
        window = desired.get("window")
        if window:  # checked again here: a document from an older control plane may hold one that never opens
            try:
                parse_window(window)
            except ValueError as e:
                return self._fail(base, DeviceState.REJECTED, f"its activation window cannot be used: {e}")
        got = self._fetch(desired, base, desired.get("jitter_s"))
        if isinstance(got, str):
            return got
        path, manifest = got
        if window and not in_window(window):
            self.wait_s = round(seconds_to_window(window))
            self._say({**base, "state": DeviceState.WAITING, "window": window, "wait_s": self.wait_s,
                       "model": self._serving()})
            return DeviceState.WAITING
        return self._switch(path, manifest, base, desired)

    def _switch(self, path: Path, manifest: dict, base: dict, desired: dict) -> str:
        """Have the agent switch to the verified version, then record it as what the next start serves."""
        active = {**manifest, "sha256": path.name}
        record = self.active_file.with_suffix(".tmp")
        try:  # written before the switch, so a full disk fails here, with the old model serving
            write_synced(record, json.dumps(active).encode())
        except OSError as e:
            self.retry = True
            return self._fail(base, DeviceState.FAILED,
                              f"{disk_cause(e)}: cannot write {record}, the old model still serves")
        self._say({**base, "state": DeviceState.ACTIVATING})
        try:
            self.activate(model_path(self.models_dir, path.name, manifest.get("format")), manifest)
        except Exception as e:  # the agent keeps its old model
            with contextlib.suppress(OSError):
                record.unlink()
            return self._fail(base, DeviceState.FAILED, f"activation failed, the old model still serves: {e}")
        try:
            os.replace(record, self.active_file)  # what the next start serves
        except OSError as e:
            self.retry = True  # the next try switches again, and records it
            return self._fail(base, DeviceState.FAILED,
                              f"{disk_cause(e)}: switched to {base['desired']} but cannot record it "
                              f"in {self.active_file}: a restart would serve the version before")
        self.active = active
        try:
            self._prune()
        except OSError as e:  # the switch is done: what is not dropped now is dropped after the next one
            log.warning("cannot drop old versions: %s", e)
        self._say({**base, "state": DeviceState.ACTIVE, "model": base["desired"], "sha256": path.name})
        self._prefetch(desired.get("prefetch"), desired.get("jitter_s"))
        return DeviceState.ACTIVE

    def _fetch(self, desired: dict, base: dict, jitter_s=None, quiet: bool = False) -> tuple[Path, dict] | str:
        """Verify ``desired`` against the signed metadata and have its file in models/ (downloaded
        after a random wait up to ``jitter_s``); (path, manifest), or the failed state. ``quiet``:
        report nothing (a prefetch)."""
        fail = self._failed(quiet)
        key = (desired.get("model"), desired.get("version"), desired.get("sha256"))
        ahead = self._prefetched.pop(key, None)
        try:
            if ahead and time.monotonic() - ahead[0] < self.config.prefetch_trust_s and \
                    (self.models_dir / str(key[2])).exists():
                info = ahead[1]  # fetched ahead and verified a moment ago: the same signed target
            else:
                tuf_url = self.config.metadata_url or f"{self.config.control_plane}/v1/tuf/"
                info = verified_target(self.config.state_dir / "tuf", tuf_url, self.config.trusted_root,
                                       desired["model"], desired["version"], self.config.auth_for(tuf_url),
                                       self.http)
        except Exception as e:
            if _transient(e) or isinstance(e, OSError):  # the network, a busy server, a full disk: try again later
                self.retry = not quiet
                return fail(base, DeviceState.FAILED, f"cannot fetch the signed metadata now: {e}")
            return fail(base, DeviceState.REJECTED, f"its signed metadata was refused: {e}")
        manifest = manifest_of(info)
        if info.hashes.get("sha256") != desired.get("sha256"):
            return fail(base, DeviceState.REJECTED, "the desired digest is not the signed target's")
        if quiet:  # a prefetch: its switch may go on this verification (used only once its file is here)
            self._prefetched[key] = (time.monotonic(), info)
        why = self._cannot_take(manifest, info.length)
        if why:
            return fail(base, DeviceState.REJECTED, why)
        path = self.models_dir / info.hashes["sha256"]
        if path.exists():
            return self._unpacked(path, manifest, base, quiet)
        if isinstance(jitter_s, (int, float)) and jitter_s > 0:
            time.sleep(random.uniform(0, min(jitter_s, MAX_JITTER_S)))
        say = (lambda state: None) if quiet else self._say
        say({**base, "state": DeviceState.DOWNLOADING, "done": 0, "total": info.length})
        base_url = self.config.artifact_url or f"{self.config.control_plane}/v1/artifacts"
        url = f"{base_url.rstrip('/')}/{info.hashes['sha256']}"
        last = [0]

        def progress(done: int, total: int) -> None:
            if done - last[0] >= max(total // 10, 1) or done == total:
                last[0] = done
                say({**base, "state": DeviceState.DOWNLOADING, "done": done, "total": total})
            if done == total:
                say({**base, "state": DeviceState.VERIFYING})

        try:
            staged = fetch(url, self.staging / info.hashes["sha256"], info, self.http, progress=progress,
                           auth=self.config.auth_for(url))
        except DownloadError as e:  # the network's or the disk's: the follower tries again (from the bytes it
            self.retry = not quiet and not isinstance(e, ArtifactMismatch)  # has); other bytes than signed: it does not
            return fail(base, DeviceState.FAILED, str(e))
        try:
            self.models_dir.mkdir(parents=True, exist_ok=True)
            staged.replace(path)
        except OSError as e:  # the verified file stays in staging: the next try checks it again and moves it
            self.retry = not quiet
            return fail(base, DeviceState.FAILED, f"{disk_cause(e)}: cannot move the verified download to {path}")
        return self._unpacked(path, manifest, base, quiet)

    def _unpacked(self, path: Path, manifest: dict, base: dict, quiet: bool) -> tuple[Path, dict] | str:
        """An ONNX version's verified tar unpacked beside it (once); (path, manifest) or FAILED.
        A signed tar that does not unpack safely is the publisher's fault: not tried again; a disk
        that cannot take it is tried again (it may be freed)."""
        if manifest.get("format") == "onnx":
            try:
                unpack_onnx_tar(path, model_path(self.models_dir, path.name, "onnx"))
            except (OnnxModelError, OSError) as e:
                self.retry = not quiet and isinstance(e, OSError)
                return self._failed(quiet)(base, DeviceState.FAILED, f"the ONNX artifact does not unpack: {e}")
        return path, manifest

    def _prefetch(self, wanted, jitter_s) -> None:
        """Download and verify a version to activate later (a rollout's later wave), reporting it as
        ``prefetched`` beside the state; a failure is reported and tried again with the next document."""
        if not isinstance(wanted, dict) or (self.models_dir / str(wanted.get("sha256"))).exists():
            return
        ref = f"{wanted.get('model')}@{wanted.get('version')}"
        try:
            got = self._fetch(wanted, {"desired": ref}, jitter_s, quiet=True)
        except Exception:  # the version serving is not touched: said as the prefetch's state
            log.exception("prefetching %s failed", ref)
            got = DeviceState.FAILED
        state = {"desired": self._serving(), "state": DeviceState.ACTIVE, "model": self._serving(),
                 "sha256": self.active.get("sha256")}
        if isinstance(got, str):
            self._say({**state, **self._last_base, "prefetch": ref, "prefetch_state": got})
        else:
            log.info("prefetched %s", ref)
            self._say({**state, **self._last_base, "prefetch": ref, "prefetch_state": "READY"})

    def _cannot_take(self, manifest: dict, length: int) -> str | None:
        fmt = manifest.get("format")
        if fmt not in FORMATS:
            return f"format {fmt!r} cannot be served by this agent ({', '.join(FORMATS)})"
        if fmt == "onnx" and importlib.util.find_spec("onnxruntime_genai") is None:
            return ("format 'onnx' cannot be served by this agent: onnxruntime-genai is not installed here "
                    "(the onnx or onnx-cuda extra)")
        need = manifest.get("min_agent_version")
        if need and parse_semver(need) > parse_semver(self.config.agent_version):
            return f"it needs agent {need}, this agent is {self.config.agent_version}"
        memory = self.config.memory_budget_bytes or available_memory()
        if memory and length > memory:  # the new version loads beside the old one before the switch
            return f"it needs about {length} bytes of memory, {memory} are available"
        # an ONNX tar is kept (verified at start) beside its unpacked files: about twice its length
        need = 2 * length if fmt == "onnx" else length
        why = self._make_room(manifest.get("sha256", "-"), need)
        if why:
            return why
        if shutil.disk_usage(self.config.state_dir).free < need:
            return f"{need} bytes do not fit the free disk space"
        return None

    def _make_room(self, sha256: str, length: int) -> str | None:
        """Fit ``length`` more bytes in the disk budget, dropping kept versions other than the active
        one, oldest first, if that is what it takes; the reason when even that is not enough."""
        if (self.models_dir / sha256).exists():
            return None
        budget = self.config.disk_budget_bytes
        kept_versions = kept(self.models_dir)  # oldest first
        active = None if self.active is None else self.active.get("sha256")
        taken = sum(size for sha, size in kept_versions if sha == active)
        if taken + length > budget:
            return f"{length} bytes do not fit the disk budget ({budget} bytes, {taken} taken by the active version)"
        used = sum(size for _, size in kept_versions)
        for sha, size in kept_versions:
            if used + length <= budget:
                break
            if sha != active:
                used -= size
                drop(self.models_dir, sha)
                log.info("dropped %s to fit the disk budget", sha[:12])
        return None

    def _prune(self) -> None:
        """Keep the active version and the ones before it, up to ``keep_versions``."""
        (self.models_dir / self.active["sha256"]).touch()  # a version gone back to counts as the newest
        for sha, _ in kept(self.models_dir)[:-self.config.keep_versions or None]:
            drop(self.models_dir, sha)

    def _serving(self) -> str | None:
        return None if self.active is None else f"{self.active.get('name')}@{self.active.get('version')}"

    def _failed(self, quiet: bool) -> Callable[[dict, str, str], str]:
        """How a step ends in failure: reported (``_fail``), or for a prefetch only returned."""
        return (lambda base, state, reason: state) if quiet else self._fail

    def _fail(self, base: dict, state: str, reason: str) -> str:
        reason = one_line(reason)
        log.error("%s %s: %s", base["desired"], state, reason)
        self._say({**base, "state": state, "reason": reason, "retry": self.retry,  # a FAILED it tries again
                   "model": self._serving()})
        return state

    def _say(self, state: dict) -> None:
        """Report ``state``, each string in it one bounded line (``one_line``)."""
        state = {k: one_line(v, REASON_CHARS if k == "reason" else TEXT_CHARS) if isinstance(v, str) else v
                 for k, v in state.items()}
        if "rev" in state:
            self._last_base = {"desired": state.get("desired"), "rev": state["rev"]}
        if "prefetch" not in state:
            self._step = state.get("state") or ""
        try:
            self.report(state)
        except Exception:  # a report that cannot go out does not stop the change
            log.exception("cannot report %s", state.get("state"))


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """``text`` as a device says it: every control character, line separator and lone surrogate
    made a space (the control plane refuses them: they would forge a log line or split a record),
    cut to ``limit`` characters."""
    flat = _UNSAFE_TEXT.sub(" ", text)
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


def _transient(e: Exception) -> bool:
    """A metadata failure worth trying again: the network, a timeout, a busy or failing server
    (408, 429, 5xx); not a refused signature, a rollback, expired metadata or a 401/403/404."""
    if isinstance(e, tuf_errors.DownloadHTTPError):
        return e.status_code in (408, 429) or e.status_code >= 500
    return isinstance(e, (tuf_errors.DownloadError, httpx.TransportError))
