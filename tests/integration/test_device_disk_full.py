"""A device whose disk really fills mid-download (a small tmpfs; skipped where this process cannot
mount one): the download is FAILED with the cause and tried again, the old model keeps serving,
and once space is freed the next try resumes from the bytes the disk took and reaches ACTIVE.
tests/unit/test_device_update_faults.py injects the same fault where no tmpfs can be mounted."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.unit.test_device_update_faults import SIZE, FakePlane, assert_still_on


@pytest.fixture
def small_disk(tmp_path):
    disk = tmp_path / "disk"
    disk.mkdir()
    if shutil.which("mount") is None or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_disk_that_fills_mid_download_fails_to_retry_and_resumes_once_space_is_freed(small_disk, tmp_path):
    plane = FakePlane(tmp_path / "fleet")
    v1, v2 = plane.publish("1.0.0"), plane.publish("1.1.0")
    up, states = plane.device(small_disk / "device")
    assert up.apply({**v1, "rev": 1}) == "ACTIVE"

    filler = small_disk / "other-process.bin"
    fill_from, filled = len(states), []

    def another_process_fills_the_disk(state: dict) -> None:  # once v2 passed the free-space check
        states.append(state)
        if state["state"] == "DOWNLOADING" and state.get("done") == 0 and not filled:
            with open(filler, "wb") as f:
                f.write(b"\0" * (shutil.disk_usage(small_disk).free - SIZE // 2))
            filled.append(filler)

    up.report = another_process_fills_the_disk
    assert up.apply({**v2, "rev": 2}) == "FAILED"
    failed = states[-1]
    assert up.retry and failed["retry"] is True and failed["reason"].startswith("no space left on device: "), failed
    assert "bytes kept: the next try resumes" in failed["reason"] and "\n" not in failed["reason"]
    assert any(s["state"] == "DOWNLOADING" for s in states[fill_from:])
    kept = (small_disk / "device" / "staging" / f"{v2['sha256']}.part").stat().st_size
    assert 0 < kept < SIZE
    assert_still_on(up, small_disk / "device", "1.0.0", states)

    filler.unlink()  # space freed
    assert up.apply({**v2, "rev": 2}) == "ACTIVE", states[-1]
    assert plane.ranges[-1] == f"bytes={kept}-"
    assert json.loads((small_disk / "device" / "active.json").read_text())["version"] == "1.1.0"
    up.close()
    plane.close()
