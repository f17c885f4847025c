"""`cascade fleet serve` (a real process) and a device's side of it: the signed metadata through
python-tuf's client, the artifact by sha256 with HTTP Range, a download that resumes from the
bytes it has and is verified against the signed target before use; the device endpoints behind
the device's own credentials (HTTP Basic device_id:secret) or the admin key; and a mirror: the
same files on a plain static server, verified all the same."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import shutil
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cascade.processes import free_port
from model_distribution.artifacts.download import DownloadError, fetch
from model_distribution.fleet.desired import verify_desired
from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from model_distribution.registry.tuf_client import verified_target
from sync.mqtt_link import stop_loop
from tests import loopback
from tests.conftest import Server
from tests.unit.sync.test_mqtt import MOSQUITTO, Mosquitto, wait_until
from tests.unit.test_registry import make_gguf

ADMIN_KEY = "admin-key-for-tests"
NO_BROKER = {"CASCADE_FLEET_MQTT_START": "false"}  # = --no-broker: these servers need no MQTT broker of their own


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
    store = DeviceStore(home / "fleet")
    secrets_ = {d: store.add(d, ["kiosks"]) for d in ("kiosk-7", "kiosk-8")}
    store.assign(m, device_id="kiosk-7")
    store.close()
    reg.close()
    s = Server(home, ["fleet", "serve"], env={"CASCADE_FLEET_SERVER_ADMIN_KEY": ADMIN_KEY, **NO_BROKER})
    s.wait_healthy(60)
    s.home, s.repo, s.manifest, s.src, s.secrets = home, repo, m, src, secrets_
    s.auth = ("kiosk-7", secrets_["kiosk-7"])
    yield s
    s.stop()


def target(plane, tmp_path, auth=None):
    return verified_target(tmp_path / "device-tuf", f"{plane.url}/v1/tuf/", plane.repo.root_bytes(), "tiny", "1.0.0",
                           auth or plane.auth)


def test_a_device_verifies_and_downloads_a_version(plane, tmp_path):
    info = target(plane, tmp_path)
    assert info.hashes["sha256"] == plane.manifest.sha256
    seen = []
    out = fetch(f"{plane.url}/v1/artifacts/{plane.manifest.sha256}", tmp_path / "tiny.gguf", info,
                progress=lambda done, total: seen.append((done, total)), auth=plane.auth)
    assert hashlib.sha256(out.read_bytes()).hexdigest() == plane.manifest.sha256
    assert seen[-1] == (plane.manifest.size, plane.manifest.size)


def test_a_download_with_credentials_resumes_from_the_bytes_it_has(plane, tmp_path):
    info = target(plane, tmp_path)
    data = plane.src.read_bytes()
    dest = tmp_path / "tiny.gguf"
    (tmp_path / "tiny.gguf.part").write_bytes(data[: len(data) // 2])  # killed half way
    seen = []
    fetch(f"{plane.url}/v1/artifacts/{plane.manifest.sha256}", dest, info, progress=lambda d, t: seen.append(d),
          auth=plane.auth)
    assert dest.read_bytes() == data and seen[0] > len(data) // 2  # it went on from the middle


def test_bytes_that_do_not_match_the_signed_target_are_refused_and_dropped(plane, tmp_path):
    info = target(plane, tmp_path)
    data = bytearray(plane.src.read_bytes())
    data[10] ^= 0xFF
    part = tmp_path / "tiny.gguf.part"
    part.write_bytes(bytes(data[: len(data) - 5]))  # a corrupted start: the resumed file cannot verify
    with pytest.raises(DownloadError, match="does not match its signed target"):
        fetch(f"{plane.url}/v1/artifacts/{plane.manifest.sha256}", tmp_path / "tiny.gguf", info, auth=plane.auth)
    assert not part.exists() and not (tmp_path / "tiny.gguf").exists()


def test_artifacts_answer_ranges_with_the_digest_as_etag(plane):
    url = f"{plane.url}/v1/artifacts/{plane.manifest.sha256}"
    r = loopback.get(url, headers={"Range": "bytes=10-19"}, auth=plane.auth)
    assert r.status_code == 206 and r.content == plane.src.read_bytes()[10:20]
    assert r.headers["etag"] == f'"{plane.manifest.sha256}"' and r.headers["accept-ranges"] == "bytes"
    assert r.headers["cache-control"].startswith("private")  # no shared cache hands it out without credentials
    assert loopback.get(f"{plane.url}/v1/artifacts/{'0' * 64}", auth=plane.auth).status_code == 404
    bad = loopback.get(f"{plane.url}/v1/artifacts/not-a-digest", auth=plane.auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "sha256"


def test_only_metadata_files_are_served(plane):
    assert loopback.get(f"{plane.url}/v1/tuf/1.root.json", auth=plane.auth).status_code == 200
    for name in ("..%2Fkeys%2Froot.pem", "root.pem", "2.root.json.tmp"):
        assert loopback.get(f"{plane.url}/v1/tuf/{name}", auth=plane.auth).status_code == 404


def test_the_admin_models_list_needs_the_admin_key(plane):
    assert loopback.get(f"{plane.url}/v1/fleet/models").status_code == 401
    assert loopback.get(f"{plane.url}/v1/fleet/models", auth=plane.auth).status_code == 401  # a device is no admin
    r = loopback.get(f"{plane.url}/v1/fleet/models", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200 and [m["sha256"] for m in r.json()["data"]] == [plane.manifest.sha256]


@pytest.mark.parametrize("path, body", [
    ("/v1/fleet/devices", b'{"device": "k9", "groups": NaN}'),
    ("/v1/fleet/devices", b'{"device": 1e999}'),
    ("/v1/fleet/devices", b'{"device": "k9", "groups": "not-a-list"}'),
    ("/v1/fleet/devices", b'{"device": "k\\u2028x"}'),
    ("/v1/fleet/devices", b'{"device": "cascade-control-plane"}'),  # the control plane's own broker name
    ("/v1/fleet/devices", b'{"device": "k9", "extra": 1}'),
    ("/v1/fleet/devices", b'{"device": "' + b"k" * (70 << 10) + b'"}'),  # over the 64 KiB body bound
    ("/v1/fleet/assign", b'{"model": 123456789012345678901234567890}'),
    ("/v1/fleet/assign", b'{"model": "tiny@1.0.0", "device": ["k1"]}'),
    ("/v1/fleet/assign", b'{"model": "tiny@1.0.0"'),
], ids=["nan", "1e999", "wrong-type", "u2028", "reserved-name", "unknown-key", "oversize", "huge-int",
        "list-for-str", "truncated"])
def test_the_admin_write_routes_refuse_hostile_bodies_with_a_4xx_and_write_nothing(plane, path, body):
    admin = {"Authorization": f"Bearer {ADMIN_KEY}", "Content-Type": "application/json"}
    before = loopback.get(f"{plane.url}/v1/fleet/devices", headers=admin).json()
    r = loopback.post(f"{plane.url}{path}", content=body, headers=admin)
    assert 400 <= r.status_code < 500 and r.json()["error"]["message"], (r.status_code, r.text[:300])
    assert loopback.get(f"{plane.url}/v1/fleet/devices", headers=admin).json() == before


# -- device credentials ------------------------------------------------------------------------

def device_urls(plane) -> list[str]:
    return [f"{plane.url}/v1/artifacts/{plane.manifest.sha256}", f"{plane.url}/v1/tuf/1.root.json",
            f"{plane.url}/v1/devices/kiosk-7/desired"]


@pytest.mark.parametrize("auth", [None, ("kiosk-7", "not-its-secret"), ("nobody", "x"), ("kiosk-7", "")],
                         ids=["none", "wrong-secret", "unknown-device", "empty-secret"])
def test_device_endpoints_refuse_missing_or_wrong_credentials_with_401(plane, auth):
    for url in device_urls(plane):
        r = loopback.get(url, auth=auth)
        assert r.status_code == 401, url
        assert r.headers["www-authenticate"].startswith("Basic") and r.json()["error"]["type"] == "authentication_error"
    wrong_bearer = loopback.get(device_urls(plane)[0], headers={"Authorization": "Bearer not-the-admin-key"})
    assert wrong_bearer.status_code == 401


def test_the_devices_own_credentials_and_the_admin_key_open_the_device_endpoints(plane):
    for url in device_urls(plane):
        assert loopback.get(url, auth=plane.auth).status_code == 200, url
        assert loopback.get(url, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200, url
    for _ in range(20):  # verified once, then remembered: no scrypt per request
        assert loopback.get(device_urls(plane)[1], auth=plane.auth).status_code == 200


def test_a_device_reads_only_its_own_signed_desired_state(plane):
    r = loopback.get(f"{plane.url}/v1/devices/kiosk-7/desired", auth=plane.auth)
    payload = verify_desired(r.content, plane.repo.desired_public_key(), "kiosk-7")  # as it checks the MQTT message
    assert (payload["model"], payload["version"], payload["sha256"]) == ("tiny", "1.0.0", plane.manifest.sha256)
    again = loopback.get(f"{plane.url}/v1/devices/kiosk-7/desired", auth=plane.auth)
    assert again.content == r.content  # signed once per revision
    other = ("kiosk-8", plane.secrets["kiosk-8"])
    forbidden = loopback.get(f"{plane.url}/v1/devices/kiosk-7/desired", auth=other)
    assert forbidden.status_code == 403 and forbidden.json()["error"]["type"] == "permission_error"
    assert loopback.get(f"{plane.url}/v1/devices/kiosk-8/desired", auth=other).status_code == 404  # nothing assigned


def test_a_device_reports_its_state_over_http_as_over_mqtt(plane):
    report = {"state": "ACTIVE", "model": "tiny@1.0.0", "sha256": plane.manifest.sha256, "rev": 1}
    other = ("kiosk-8", plane.secrets["kiosk-8"])
    assert loopback.post(f"{plane.url}/v1/devices/kiosk-7/reported", json=report, auth=other).status_code == 403
    assert loopback.post(f"{plane.url}/v1/devices/kiosk-7/reported", json=report).status_code == 401
    bad = loopback.post(f"{plane.url}/v1/devices/kiosk-7/reported", content=b"[1, 2", auth=plane.auth)
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "invalid_json"
    assert loopback.post(f"{plane.url}/v1/devices/kiosk-7/reported", json=report, auth=plane.auth).status_code == 204
    listed = loopback.get(f"{plane.url}/v1/fleet/devices", headers={"Authorization": f"Bearer {ADMIN_KEY}"}).json()
    rows = {d["device"]: d for d in listed["data"]}
    assert rows["kiosk-7"]["reported"] == report and rows["kiosk-7"]["last_seen"]
    assert rows["kiosk-8"]["reported"] is None


@pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")
def test_the_http_desired_document_is_the_retained_mqtt_message(tmp_path):
    import paho.mqtt.client as mqtt

    from model_distribution.protocol.topics import topic

    broker = Mosquitto(tmp_path / "broker")
    broker.start()
    home = tmp_path / "home"
    Repository(home / "fleet").init()
    reg = Registry(home / "fleet")
    m, _ = reg.push(make_gguf(tmp_path / "a.gguf"), "tiny", "1.0.0")
    reg.close()
    store = DeviceStore(home / "fleet")
    secret = store.add("kiosk-1", ["kiosks"])
    server = Server(home, ["fleet", "serve"], "--broker", f"mqtt://127.0.0.1:{broker.port}").wait_healthy(60)
    got: list[bytes] = []
    sub = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id="t-retained", protocol=mqtt.MQTTv311)
    sub.on_message = lambda c, u, msg: got.append(msg.payload)
    try:
        store.assign(m, device_id="kiosk-1")
        http = loopback.get(f"{server.url}/v1/devices/kiosk-1/desired", auth=("kiosk-1", secret))  # before it goes out
        assert http.status_code == 200
        assert sub.connect("127.0.0.1", broker.port) == 0
        sub.loop_start()
        sub.subscribe(topic("default", "kiosk-1", "desired"), qos=1)
        wait_until(lambda: got, "the retained desired message")
        assert got[-1] == http.content
    finally:
        stop_loop(sub)
        store.close()
        server.stop()
        broker.stop()


@contextlib.contextmanager
def serve_in_thread(config):
    """The control plane's app under uvicorn on a thread (a config the subprocess fixture has not)."""
    import uvicorn

    from model_distribution.control_plane.server import build_app

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(build_app(config), host="127.0.0.1", port=port, log_level="warning"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        for _ in range(200):
            if server.started:
                break
            t.join(0.05)
        assert server.started, "the control plane did not start"
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        t.join(15)


def test_public_downloads_open_artifacts_and_metadata_but_not_a_devices_state(tmp_path):
    from model_distribution.control_plane.config import ControlPlaneServerConfig, FleetConfig, StateConfig

    root = tmp_path / "fleet"
    repo = Repository(root)
    repo.init()
    reg = Registry(root)
    m, _ = reg.push(make_gguf(tmp_path / "a.gguf"), "tiny", "1.0.0")
    repo.add_target(m.name, m.version, m.sha256, m.size, m.signable())
    reg.close()
    store = DeviceStore(root)
    store.add("kiosk-1", [])
    store.assign(m, device_id="kiosk-1")
    store.close()
    config = FleetConfig(server=ControlPlaneServerConfig(public_downloads=True), state=StateConfig(path=str(root)))
    with serve_in_thread(config) as url:
        art = loopback.get(f"{url}/v1/artifacts/{m.sha256}")
        assert art.status_code == 200 and art.content == (root / "artifacts" / "sha256" / m.sha256).read_bytes()
        assert art.headers["cache-control"].startswith("public")  # a CDN in front may cache it for everyone
        assert loopback.get(f"{url}/v1/tuf/timestamp.json").status_code == 200
        assert loopback.get(f"{url}/v1/devices/kiosk-1/desired").status_code == 401
        assert loopback.get(f"{url}/v1/fleet/models").status_code == 200  # no admin key set: loopback only


def updater(plane, tmp_path, activated, **config):
    from model_distribution.device.client import DeviceConfig, DeviceUpdater

    states: list[dict] = []
    cfg = DeviceConfig("kiosk-7", plane.url, plane.repo.root_bytes(), tmp_path / "device",
                       **{"secret": plane.secrets["kiosk-7"], **config})
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
    ({}, {"secret": ""}, "signed metadata was refused"),  # no credentials: the metadata is not served to it
    ({}, {"secret": "not-its-secret"}, "signed metadata was refused"),
])
def test_the_device_client_rejects_what_it_cannot_take_and_keeps_the_old_model(plane, tmp_path, change, config,
                                                                               says):
    activated = []
    up, states = updater(plane, tmp_path, activated, **config)
    assert up.apply(desired(plane, **change)) == "REJECTED"
    assert says in states[-1]["reason"] and not activated


def test_a_failed_activation_is_reported_and_nothing_changes(plane, tmp_path):
    from model_distribution.device.client import DeviceConfig, DeviceUpdater

    states = []

    def broken(path, manifest):
        raise RuntimeError("the model does not load")

    up = DeviceUpdater(DeviceConfig("kiosk-7", plane.url, plane.repo.root_bytes(), tmp_path / "d",
                                    secret=plane.secrets["kiosk-7"]), states.append, broken)
    assert up.apply(desired(plane)) == "FAILED"
    assert "old model still serves" in states[-1]["reason"] and up.active is None


# -- a mirror: the same files on a plain static server -----------------------------------------

@pytest.fixture
def mirror(plane, tmp_path):
    """``$CASCADE_HOME/fleet/artifacts/sha256/*`` and ``tuf/*`` copied to a static server's
    ``v1/artifacts/`` and ``v1/tuf/`` (python's http.server: no credentials, no Range)."""
    site = tmp_path / "site"
    shutil.copytree(plane.home / "fleet" / "artifacts" / "sha256", site / "v1" / "artifacts")
    shutil.copytree(plane.repo.metadata_dir, site / "v1" / "tuf")
    seen: list[tuple[str, str | None]] = []

    class Static(SimpleHTTPRequestHandler):
        def do_GET(self):
            seen.append((self.path, self.headers.get("Authorization")))
            super().do_GET()

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Static, directory=str(site)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    httpd.site, httpd.seen, httpd.url = site, seen, f"http://127.0.0.1:{httpd.server_address[1]}"
    yield httpd
    httpd.shutdown()
    httpd.server_close()


def mirrored(plane, mirror, tmp_path, activated):
    return updater(plane, tmp_path, activated, artifact_url=f"{mirror.url}/v1/artifacts",
                   metadata_url=f"{mirror.url}/v1/tuf/")


def test_a_device_installs_from_a_static_mirror_and_sends_it_no_secret(plane, mirror, tmp_path):
    activated = []
    up, states = mirrored(plane, mirror, tmp_path, activated)
    assert up.apply(desired(plane)) == "ACTIVE", states[-1]
    (path, _), = activated
    assert hashlib.sha256(path.read_bytes()).hexdigest() == plane.manifest.sha256
    paths = [p for p, _ in mirror.seen]
    assert f"/v1/artifacts/{plane.manifest.sha256}" in paths and "/v1/tuf/timestamp.json" in paths
    assert all(auth is None for _, auth in mirror.seen)  # the device's secret is for the control plane only


def test_a_tampered_mirror_artifact_is_refused(plane, mirror, tmp_path):
    art = mirror.site / "v1" / "artifacts" / plane.manifest.sha256
    data = bytearray(art.read_bytes())
    data[-1] ^= 0xFF
    art.write_bytes(bytes(data))
    activated = []
    up, states = mirrored(plane, mirror, tmp_path, activated)
    assert up.apply(desired(plane)) == "FAILED"
    assert "does not match its signed target" in states[-1]["reason"] and not activated
    assert not any((tmp_path / "device" / "models").glob("*"))


def test_tampered_mirror_metadata_is_refused(plane, mirror, tmp_path):
    ts = mirror.site / "v1" / "tuf" / "timestamp.json"
    doc = json.loads(ts.read_text())
    doc["signed"]["expires"] = "2099-01-01T00:00:00Z"  # a freeze attempt: the signature no longer holds
    ts.write_text(json.dumps(doc))
    activated = []
    up, states = mirrored(plane, mirror, tmp_path, activated)
    assert up.apply(desired(plane)) == "REJECTED"
    assert "signed metadata was refused" in states[-1]["reason"] and not activated


def test_guessing_a_devices_secret_is_throttled_and_its_own_pair_still_works_once_known(plane):
    """Wrong secrets cost a scrypt each: after ten from one address in a minute the control plane
    answers 429 with Retry-After without checking; the device's cached pair is unaffected."""
    url = f"{plane.url}/v1/tuf/timestamp.json"
    assert loopback.get(url, auth=("kiosk-8", plane.secrets["kiosk-8"])).status_code == 200  # known now
    codes = [loopback.get(url, auth=("kiosk-8", f"guess-{i}")).status_code for i in range(12)]
    assert codes[:10] == [401] * 10 and codes[10:] == [429, 429], codes
    r = loopback.get(url, auth=("kiosk-8", "guess-x"))
    assert r.status_code == 429 and 1 <= int(r.headers["retry-after"]) <= 60 and r.json()["error"]["message"]
    assert loopback.get(url, auth=("kiosk-8", plane.secrets["kiosk-8"])).status_code == 200


def test_nobody_can_lock_a_device_out_nor_dodge_the_throttle_with_x_forwarded_for(plane):
    """Issue 36, item 16: ten wrong secrets for a device from one address used to lock the device
    itself out (its right secret got 429 too), and a loopback caller picked the address counted
    with X-Forwarded-For (uvicorn believes it from loopback by default)."""
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    enrolled = loopback.post(f"{plane.url}/v1/fleet/devices", json={"device": "kiosk-xff"}, headers=admin)
    secret = enrolled.json()["secret"]
    url = f"{plane.url}/v1/tuf/timestamp.json"
    codes = [loopback.get(url, auth=("kiosk-xff", f"guess-{i}"), headers={"X-Forwarded-For": f"10.9.8.{i}"})
             .status_code for i in range(12)]
    assert codes[:10] == [401] * 10 and codes[10:] == [429, 429], codes  # counted against the TCP peer
    assert loopback.get(url, auth=("kiosk-xff", secret)).status_code == 200  # the device itself still gets in
