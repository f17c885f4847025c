"""A device's update never fails silently and never waits on a window that cannot open (issue 36,
items 11 and 10). DeviceUpdater runs against a small control plane of its own (the TUF metadata
of a real Repository and the artifacts with HTTP Range, over real HTTP); faults are injected where
a device meets them: the disk fills mid-download (a file whose write takes what fits, then ENOSPC,
as write(2) does), the verified download cannot be moved, the ONNX tar cannot be unpacked,
active.json cannot be written, the agent's switch raises. Each is reported FAILED with a one-line
reason and the old model keeps serving; a full disk is tried again and resumes once freed."""

from __future__ import annotations

import datetime
import errno
import hashlib
import json
import os
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from model_distribution.artifacts import download
from model_distribution.device import client as device_client
from model_distribution.device.client import DeviceConfig, DeviceUpdater, one_line
from model_distribution.protocol.windows import in_window, parse_window, seconds_to_window
from model_distribution.registry.signing import Repository

SIZE = 3 << 20  # three of the download's 1 MiB chunks


class _Plane(BaseHTTPRequestHandler):
    """GET /tuf/<file> (the signed metadata) and /artifacts/<sha256> (with Range, as the control plane)."""

    def do_GET(self):
        plane = self.server
        if self.path.startswith("/tuf/"):
            file = plane.metadata_dir / self.path.removeprefix("/tuf/")
            return self._send(200, file.read_bytes()) if file.is_file() else self._send(404, b"")
        data = plane.artifacts.get(self.path.removeprefix("/artifacts/"))
        if data is None:
            return self._send(404, b"")
        plane.ranges.append(self.headers.get("Range"))
        start = int(self.headers["Range"].removeprefix("bytes=").rstrip("-")) if self.headers.get("Range") else 0
        self._send(206 if start else 200, data[start:],
                   {"Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"} if start else {})

    def _send(self, status: int, body: bytes, headers: dict | None = None) -> None:
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **(headers or {})}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


class FakePlane:
    """A control plane's two device-facing parts: ``publish`` signs a version and serves its bytes;
    ``ranges`` is the Range header of each artifact GET (None: from the start)."""

    def __init__(self, root: Path):
        self.repo = Repository(root)
        self.repo.init()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Plane)
        self.httpd.metadata_dir, self.httpd.artifacts, self.httpd.ranges = self.repo.metadata_dir, {}, []
        self.ranges = self.httpd.ranges
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def publish(self, version: str, fmt: str = "gguf", size: int = SIZE) -> dict:
        """Sign tiny@``version`` (``size`` bytes of its own) and serve it; its desired document."""
        data = (version.encode() * size)[:size]
        sha = hashlib.sha256(data).hexdigest()
        manifest = {"name": "tiny", "version": version, "sha256": sha, "size": size, "format": fmt}
        self.repo.add_target("tiny", version, sha, size, manifest)
        self.httpd.artifacts[sha] = data
        return {"model": "tiny", "version": version, "sha256": sha, "size": size, "format": fmt}

    def device(self, state_dir: Path, activated: list | None = None) -> tuple[DeviceUpdater, list[dict]]:
        """A DeviceUpdater of this plane; its reports, in order; ``activated`` gets each version switched to."""
        states: list[dict] = []
        cfg = DeviceConfig("kiosk-1", self.url, self.repo.root_bytes(), state_dir,
                           metadata_url=f"{self.url}/tuf/", artifact_url=f"{self.url}/artifacts")
        switched = activated if activated is not None else []
        return DeviceUpdater(cfg, states.append, lambda path, m: switched.append(m["version"])), states

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def plane(tmp_path):
    p = FakePlane(tmp_path / "fleet")
    yield p
    p.close()


class FillingFile:
    """An open file on a disk with ``room`` bytes left: a write takes what fits, then ENOSPC."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data: bytes) -> int:
        if len(data) > self.room:
            self.f.write(data[:self.room])
            self.room = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def fill_disk_after(monkeypatch, room: int) -> None:
    """The download's part file takes ``room`` bytes, then the disk is full."""
    def filling_open(path, mode="r", *args, **kwargs):
        f = open(path, mode, *args, **kwargs)
        return FillingFile(f, room) if str(path).endswith(".part") and mode != "rb" else f

    monkeypatch.setattr(download, "open", filling_open, raising=False)


def assert_one_line(state: dict) -> None:
    for v in state.values():
        assert not isinstance(v, str) or (v.isprintable() and len(v) <= 500), state


def assert_still_on(up: DeviceUpdater, state_dir: Path, version: str, states: list[dict]) -> None:
    """The old version serves, and a restart would serve it too."""
    assert up.active["version"] == version and states[-1]["model"] == f"tiny@{version}"
    assert json.loads((state_dir / "active.json").read_text())["version"] == version
    assert not (state_dir / "active.tmp").exists() and not up._lock.locked()


# -- item 11: a full disk, and every other failure, is reported ------------------------------------

def test_a_disk_full_mid_download_is_failed_to_retry_and_resumes_from_the_kept_bytes_once_freed(
        plane, tmp_path, monkeypatch):
    v1, v2 = plane.publish("1.0.0"), plane.publish("1.1.0")
    up, states = plane.device(tmp_path / "d")
    assert up.apply({**v1, "rev": 1}) == "ACTIVE"
    room = SIZE // 2 + 12345  # mid-chunk: the disk took part of a write
    fill_disk_after(monkeypatch, room)
    assert up.apply({**v2, "rev": 2}) == "FAILED"
    assert up.retry and states[-1]["retry"] is True and states[-1]["state"] == "FAILED"
    assert states[-1]["reason"].startswith("no space left on device: ")
    assert f"{room} bytes kept: the next try resumes" in states[-1]["reason"], states[-1]
    assert any(s["state"] == "DOWNLOADING" for s in states[-4:])
    assert_one_line(states[-1])
    assert (tmp_path / "d" / "staging" / f"{v2['sha256']}.part").stat().st_size == room
    assert_still_on(up, tmp_path / "d", "1.0.0", states)

    monkeypatch.undo()  # space freed
    assert up.apply({**v2, "rev": 2}) == "ACTIVE", states[-1]
    assert plane.ranges[-1] == f"bytes={room}-" and up.active["version"] == "1.1.0"
    assert json.loads((tmp_path / "d" / "active.json").read_text())["version"] == "1.1.0"
    up.close()


def test_a_failed_fsync_drops_the_bytes_so_far_and_the_next_try_starts_over(plane, tmp_path, monkeypatch):
    v1 = plane.publish("1.0.0")
    up, states = plane.device(tmp_path / "d")

    class FailingFsync:  # the download module's os, its fsync failing
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def fsync(fd):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

    monkeypatch.setattr(download, "os", FailingFsync())
    assert up.apply({**v1, "rev": 1}) == "FAILED" and up.retry
    reason = states[-1]["reason"]
    assert reason.startswith("input/output error: ") and "the next try starts over" in reason
    assert not (tmp_path / "d" / "staging" / f"{v1['sha256']}.part").exists()  # what reached the disk is unknown
    monkeypatch.undo()
    assert up.apply({**v1, "rev": 1}) == "ACTIVE" and plane.ranges[-1] is None
    up.close()


def test_a_staging_move_that_fails_is_failed_to_retry_and_the_verified_file_is_not_fetched_again(
        plane, tmp_path, monkeypatch):
    v1, v2 = plane.publish("1.0.0"), plane.publish("1.1.0")
    up, states = plane.device(tmp_path / "d")
    assert up.apply({**v1, "rev": 1}) == "ACTIVE"
    replace = Path.replace

    def full_disk_replace(self, target):
        if self.parent.name == "staging":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(target))
        return replace(self, target)

    monkeypatch.setattr(Path, "replace", full_disk_replace)
    assert up.apply({**v2, "rev": 2}) == "FAILED" and up.retry
    assert states[-1]["reason"].startswith("no space left on device: cannot move the verified download to ")
    assert_still_on(up, tmp_path / "d", "1.0.0", states)
    gets = len(plane.ranges)
    monkeypatch.undo()
    assert up.apply({**v2, "rev": 2}) == "ACTIVE" and len(plane.ranges) == gets  # checked again, not downloaded
    up.close()


def test_an_activation_that_raises_is_failed_in_one_line_and_the_old_model_serves(plane, tmp_path):
    v1, v2 = plane.publish("1.0.0"), plane.publish("1.1.0")
    up, states = plane.device(tmp_path / "d")
    assert up.apply({**v1, "rev": 1}) == "ACTIVE"

    def activate(path, manifest):
        raise RuntimeError("smoke test failed:\nline two\u2028line three\x85" + "x" * 2000)

    up.activate = activate
    assert up.apply({**v2, "rev": 2}) == "FAILED" and not up.retry
    reason = states[-1]["reason"]
    assert reason.startswith("activation failed, the old model still serves: smoke test failed: line two line three")
    assert len(reason) == 500 and reason.endswith("…")
    assert_one_line(states[-1])
    assert_still_on(up, tmp_path / "d", "1.0.0", states)
    up.close()


def test_active_json_that_cannot_be_written_fails_before_the_switch(plane, tmp_path, monkeypatch):
    v1, v2 = plane.publish("1.0.0"), plane.publish("1.1.0")
    activated: list[str] = []
    up, states = plane.device(tmp_path / "d", activated)
    assert up.apply({**v1, "rev": 1}) == "ACTIVE"

    def full(path, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(device_client, "write_synced", full)
    assert up.apply({**v2, "rev": 2}) == "FAILED" and up.retry and activated == ["1.0.0"]
    assert states[-1]["reason"].startswith("no space left on device: cannot write ")
    assert_still_on(up, tmp_path / "d", "1.0.0", states)
    up.close()


@pytest.mark.parametrize("fault, retry", [(RuntimeError("tar\nreader bug"), False),
                                          (OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), True)])
def test_an_onnx_unpack_that_raises_is_failed_and_the_old_model_serves(plane, tmp_path, monkeypatch, fault, retry):
    v1, v2 = plane.publish("1.0.0"), plane.publish("1.1.0", fmt="onnx")
    activated: list[str] = []
    up, states = plane.device(tmp_path / "d", activated)
    assert up.apply({**v1, "rev": 1}) == "ACTIVE"

    def unpack(path, dest):
        raise fault

    monkeypatch.setattr(device_client, "unpack_onnx_tar", unpack)
    monkeypatch.setattr(DeviceUpdater, "_cannot_take", lambda self, manifest, length: None)  # onnxruntime-genai or not
    assert up.apply({**v2, "rev": 2}) == "FAILED" and up.retry is retry and states[-1]["retry"] is retry
    reason = states[-1]["reason"]
    if retry:
        assert reason.startswith("the ONNX artifact does not unpack: [Errno 28] No space left on device")
    else:
        assert reason == "unexpected RuntimeError while verifying, the old model still serves: tar reader bug"
    assert activated == ["1.0.0"]
    assert_still_on(up, tmp_path / "d", "1.0.0", states)
    up.close()


def test_every_string_a_device_says_is_one_bounded_line():
    assert one_line("a\nb\r\tc\x00d\x7fe\x85f\u2028g\u2029h\ud800i") == "a b  c d e f g h i"
    assert one_line("é ü 模型 ✓") == "é ü 模型 ✓"
    assert len(one_line("x" * 600)) == 500 and one_line("x" * 600, 200) == "x" * 199 + "…"
    states: list[dict] = []
    up = DeviceUpdater(DeviceConfig("kiosk-1", "http://127.0.0.1:9", b"{}", Path("/nonexistent")), states.append,
                       lambda path, m: None, active=None)
    up._say({"desired": "tiny\n@1.0.0", "state": "FAILED", "reason": "r\n" * 400, "rev": 3, "retry": True})
    assert states == [{"desired": "tiny @1.0.0", "state": "FAILED", "reason": ("r " * 250)[:499] + "…", "rev": 3,
                       "retry": True}]
    up.close()


# -- item 10: windows that never open -------------------------------------------------------------

@pytest.mark.parametrize("text, window", [
    ("02:00-05:00", (120, 300)),
    (" 22:00 - 04:00 ", (1320, 240)),  # past midnight
    ("00:00-24:00", (0, 1440)),  # always open
    ("23:59-24:00", (1439, 1440)),
    ("* 2-4 * * 1-5", "* 2-4 * * 1-5"),
    ("0 0 1 1 *", "0 0 1 1 *"),  # once a year
    ("0 0 29 2 1", "0 0 29 2 1"),  # day-of-month or weekday (cron's rule): every Monday of February too
    ("0 0 L 2 *", "0 0 L 2 *"),
])
def test_windows_that_open(text, window):
    assert parse_window(text) == window


@pytest.mark.parametrize("text, why", [
    ("02:00-02:00", "never opens: it starts and ends at the same time (00:00-24:00 is always open)"),
    ("00:00-00:00", "never opens"),
    ("00:00-24:01", "must be HH:MM-HH:MM, from 00:00-23:59 to 00:00-24:00"),
    ("24:00-02:00", "must be HH:MM-HH:MM"),
    ("02:60-03:00", "must be HH:MM-HH:MM"),
    ("0 0 31 2 *", "never opens: cron finds no date it matches"),  # 31 February
    ("0 0 30 2 *", "never opens"),
    ("0 0 31 4,6,9,11 *", "never opens"),
    ("0 0 29 2 *", "opens less than once in 400 days"),  # leap days only: refused whatever the date
    ("0 0 * 2 1#5", "never opens: cron finds no date it matches in 9 years"),  # a fifth Monday of February: 2044
    ("H 2 * * *", "five-field cron expression"),
    ("* 2-4 * *", "five-field cron expression"),
    ("", "five-field cron expression"),
    (None, "must be a string"),
    (120, "must be a string"),
])
def test_windows_that_never_open_are_refused_saying_why(text, why):
    with pytest.raises(ValueError, match="window .*" + why.replace("(", r"\(").replace(")", r"\)")):
        parse_window(text)
    # and the device's checks stay total: such a window never raises and never holds a device back
    at = datetime.datetime(2026, 12, 1, 3, 30)
    assert in_window(text, at) is True and seconds_to_window(text, at) == 0.0


def test_a_rollout_with_a_window_that_never_opens_is_refused_up_front():
    from model_distribution.rollout.spec import RolloutError, RolloutSpec

    for bad in ("02:00-02:00", "0 0 31 2 *"):
        with pytest.raises(RolloutError, match="never opens"):
            RolloutSpec("tiny@1.1.0", "kiosks", window=bad)
    assert RolloutSpec("tiny@1.1.0", "kiosks", window="00:00-24:00").window == "00:00-24:00"


def test_a_cron_window_waits_at_most_a_year_and_always_a_finite_time():
    at = datetime.datetime(2026, 3, 2, 12, 0)  # after 1 January
    assert seconds_to_window("0 0 1 1 *", at) == (datetime.datetime(2027, 1, 1) - at).total_seconds()
    assert in_window("00:00-24:00", at) and seconds_to_window("00:00-24:00", at) == 0.0


def test_a_document_whose_window_never_opens_is_rejected_before_anything_is_fetched(plane, tmp_path):
    v1 = plane.publish("1.0.0")
    up, states = plane.device(tmp_path / "d")
    for window in ("03:00-03:00", "0 0 31 2 *"):
        assert up.apply({**v1, "rev": 1, "window": window}) == "REJECTED"
        assert states[-1]["reason"].startswith(f"its activation window cannot be used: window {window!r} never opens")
        assert not states[-1]["retry"] and up.wait_s is None and not up._lock.locked()
    assert plane.ranges == [] and [s["state"] for s in states] == ["REJECTED", "REJECTED"]
    up.close()


def test_waiting_for_a_window_says_how_long(plane, tmp_path):
    v1 = plane.publish("1.0.0")
    up, states = plane.device(tmp_path / "d")
    hour = datetime.datetime.now().hour
    closed = f"{(hour + 2) % 24:02d}:00-{(hour + 3) % 24:02d}:00"
    assert up.apply({**v1, "rev": 1, "window": closed}) == "WAITING"
    wait_s = states[-1]["wait_s"]
    assert states[-1]["state"] == "WAITING" and isinstance(wait_s, int) and wait_s == up.wait_s
    assert 0 < wait_s <= 2 * 3600
    up.close()
