"""`cascade fleet serve` (a real process) and a device's side of it: the signed metadata through
python-tuf's client, the artifact by sha256 with HTTP Range, a download that resumes from the
bytes it has and is verified against the signed target before use."""

from __future__ import annotations

import hashlib

import httpx
import pytest

from model_distribution.download import DownloadError, fetch
from model_distribution.registry import Registry
from model_distribution.signing import Repository, verified_target
from tests.conftest import Server
from tests.unit.test_registry import make_gguf


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    home = tmp_path_factory.mktemp("fleet-home")
    repo = Repository(home / "fleet")
    repo.init()
    reg = Registry(home / "fleet")
    src = make_gguf(home / "tiny.gguf", 3.0)
    with open(src, "ab") as f:  # a few MiB, so a download has several chunks
        f.write(bytes(range(256)) * 16384)
    m, _ = reg.push(src, "tiny", "1.0.0")
    repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
    reg.close()
    s = Server(home, ["fleet", "serve"]).wait_healthy(60)
    s.home, s.repo, s.manifest, s.src = home, repo, m, src
    yield s
    s.stop()


def target(plane, tmp_path):
    return verified_target(tmp_path / "device-tuf", f"{plane.url}/v1/tuf/", plane.repo.root_bytes(), "tiny", "1.0.0")


def test_a_device_verifies_and_downloads_a_version(plane, tmp_path):
    info = target(plane, tmp_path)
    assert info.hashes["sha256"] == plane.manifest.sha256
    seen = []
    out = fetch(f"{plane.url}/v1/artifacts/{plane.manifest.sha256}", tmp_path / "tiny.gguf", info,
                progress=lambda done, total: seen.append((done, total)))
    assert hashlib.sha256(out.read_bytes()).hexdigest() == plane.manifest.sha256
    assert seen[-1] == (plane.manifest.size, plane.manifest.size)


def test_a_download_resumes_from_the_bytes_it_has(plane, tmp_path):
    info = target(plane, tmp_path)
    data = plane.src.read_bytes()
    dest = tmp_path / "tiny.gguf"
    (tmp_path / "tiny.gguf.part").write_bytes(data[: len(data) // 2])  # killed half way
    seen = []
    fetch(f"{plane.url}/v1/artifacts/{plane.manifest.sha256}", dest, info, progress=lambda d, t: seen.append(d))
    assert dest.read_bytes() == data and seen[0] > len(data) // 2  # it went on from the middle


def test_bytes_that_do_not_match_the_signed_target_are_refused_and_dropped(plane, tmp_path):
    info = target(plane, tmp_path)
    data = bytearray(plane.src.read_bytes())
    data[10] ^= 0xFF
    part = tmp_path / "tiny.gguf.part"
    part.write_bytes(bytes(data[: len(data) - 5]))  # a corrupted start: the resumed file cannot verify
    with pytest.raises(DownloadError, match="does not match its signed target"):
        fetch(f"{plane.url}/v1/artifacts/{plane.manifest.sha256}", tmp_path / "tiny.gguf", info)
    assert not part.exists() and not (tmp_path / "tiny.gguf").exists()


def test_artifacts_answer_ranges_with_the_digest_as_etag(plane):
    url = f"{plane.url}/v1/artifacts/{plane.manifest.sha256}"
    r = httpx.get(url, headers={"Range": "bytes=10-19"})
    assert r.status_code == 206 and r.content == plane.src.read_bytes()[10:20]
    assert r.headers["etag"] == f'"{plane.manifest.sha256}"' and r.headers["accept-ranges"] == "bytes"
    assert httpx.get(f"{plane.url}/v1/artifacts/{'0' * 64}").status_code == 404
    bad = httpx.get(f"{plane.url}/v1/artifacts/not-a-digest")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sha256"


def test_only_metadata_files_are_served(plane):
    assert httpx.get(f"{plane.url}/v1/tuf/1.root.json").status_code == 200
    for name in ("..%2Fkeys%2Froot.pem", "root.pem", "2.root.json.tmp"):
        assert httpx.get(f"{plane.url}/v1/tuf/{name}").status_code == 404


def test_the_admin_models_list(plane):
    r = httpx.get(f"{plane.url}/v1/fleet/models")  # no admin key set: loopback callers only
    assert r.status_code == 200 and [m["sha256"] for m in r.json()["data"]] == [plane.manifest.sha256]


def updater(plane, tmp_path, activated, **config):
    from model_distribution.device_client import DeviceConfig, DeviceUpdater

    states: list[dict] = []
    cfg = DeviceConfig("kiosk-7", plane.url, plane.repo.root_bytes(), tmp_path / "device", **config)
    return DeviceUpdater(cfg, states.append, lambda path, m: activated.append((path, m))), states


def desired(plane, **kw):
    m = plane.manifest
    return {"model": m.name, "version": m.version, "sha256": m.sha256, "size": m.size, "format": "gguf", "rev": 1,
            **kw}


def test_the_device_client_downloads_verifies_and_activates_reporting_each_step(plane, tmp_path):
    activated = []
    up, states = updater(plane, tmp_path, activated)
    assert up.apply(desired(plane)) == "ACTIVE"
    order = [s["state"] for s in states]
    assert order[0] == "DOWNLOADING" and order[-3:] == ["VERIFYING", "ACTIVATING", "ACTIVE"]
    (path, manifest), = activated
    assert hashlib.sha256(path.read_bytes()).hexdigest() == plane.manifest.sha256 and manifest["name"] == "tiny"
    assert up.apply(desired(plane, rev=2)) == "ACTIVE" and len(activated) == 1  # already active: nothing to do


@pytest.mark.parametrize("change, config, says", [
    ({"sha256": "0" * 64}, {}, "not the signed target"),
    ({"version": "9.9.9"}, {}, "signed metadata was refused"),
    ({}, {"disk_budget_bytes": 1000}, "disk budget"),
])
def test_the_device_client_rejects_what_it_cannot_take_and_keeps_the_old_model(plane, tmp_path, change, config,
                                                                               says):
    activated = []
    up, states = updater(plane, tmp_path, activated, **config)
    assert up.apply(desired(plane, **change)) == "REJECTED"
    assert says in states[-1]["reason"] and not activated


def test_a_failed_activation_is_reported_and_nothing_changes(plane, tmp_path):
    from model_distribution.device_client import DeviceConfig, DeviceUpdater

    states = []

    def broken(path, manifest):
        raise RuntimeError("the model does not load")

    up = DeviceUpdater(DeviceConfig("kiosk-7", plane.url, plane.repo.root_bytes(), tmp_path / "d"), states.append,
                       broken)
    assert up.apply(desired(plane)) == "FAILED"
    assert "old model still serves" in states[-1]["reason"] and up.active is None
