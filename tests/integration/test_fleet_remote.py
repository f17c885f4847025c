"""`cascade fleet ... --url` against a real `cascade fleet serve`: each command over the admin
API prints what the same command prints on the control plane's own state, a wrong or missing
admin key and an unreachable control plane exit 2 with one line, a bad file is a 400 and exit 2,
a published version stays immutable over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cascade.processes import free_port
from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from model_distribution.registry.tuf_client import manifest_of, verified_target
from tests import loopback
from tests.conftest import REPO, Server
from tests.unit.test_registry import make_gguf

KEY = "remote-admin-key"
NO_BROKER = {"CASCADE_FLEET_MQTT_START": "false"}  # = --no-broker: the admin API needs no MQTT broker


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    home = tmp_path_factory.mktemp("control-plane")
    Repository(home / "fleet").init()
    s = Server(home, ["fleet", "serve"], env={"CASCADE_FLEET_SERVER_ADMIN_KEY": KEY, **NO_BROKER}).wait_healthy(60)
    s.home = home
    s.elsewhere = tmp_path_factory.mktemp("operator")  # the operator's machine: no fleet state of its own
    files = tmp_path_factory.mktemp("files")
    s.v1, s.v2 = make_gguf(files / "v1.gguf", 1.0), make_gguf(files / "v2.gguf", 2.0)
    yield s
    s.stop()


def cascade(*args, home, env=None):
    return subprocess.run([sys.executable, "-m", "cascade_cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "CASCADE_HOME": str(home), **(env or {})})


def remote(plane, *args, key=KEY):
    flags = ["--url", plane.url] + (["--admin-key", key] if key else [])
    return cascade("fleet", *args, *flags, home=plane.elsewhere)


def local(plane, *args):
    return cascade("fleet", *args, home=plane.home)


def refused(r, code=2) -> str:
    assert r.returncode == code and len(r.stderr.strip().splitlines()) == 1, (r.returncode, r.stderr)
    return r.stderr


def test_each_remote_command_prints_what_the_local_command_prints(plane, tmp_path):
    pushed = remote(plane, "push", str(plane.v1), "--name", "tiny", "--version", "1.0.0", "--json")
    assert pushed.returncode == 0, pushed.stderr
    m = json.loads(pushed.stdout)
    assert m["created"] and m["format"] == "gguf" and m["size"] == plane.v1.stat().st_size
    repo = Repository(plane.home / "fleet")
    assert repo.has_target("tiny", "1.0.0")  # signed by the control plane, as a local push signs
    again = [f(plane, "push", str(plane.v1), "--name", "tiny", "--version", "1.0.0") for f in (remote, local)]
    assert again[0].returncode == again[1].returncode == 0 and "nothing to do" in again[0].stdout
    assert again[0].stdout == again[1].stdout

    cal = tmp_path / "edge.toml"
    cal.write_text("[cascade]\nhold_tokens = 8\nmax_prompt_tokens = 900\n")
    with_cal = remote(plane, "push", str(plane.v2), "--name", "tiny", "--version", "1.1.0", "--calibration", str(cal),
                      "--min-agent-version", "0.1.0", "--json")
    assert with_cal.returncode == 0, with_cal.stderr
    assert json.loads(with_cal.stdout)["calibration"] == {"hold_tokens": 8, "max_prompt_tokens": 900}

    for args in (["models"], ["models", "--json"], ["models", "--name", "tiny", "--json"]):
        r, loc = remote(plane, *args), local(plane, *args)
        assert r.returncode == loc.returncode == 0 and r.stdout == loc.stdout, args

    added = remote(plane, "devices", "add", "kiosk-1", "--group", "kiosks", "--json")
    assert added.returncode == 0, added.stderr
    creds = json.loads(added.stdout)
    assert (creds["device"], creds["groups"], creds["fleet"]) == ("kiosk-1", ["kiosks"], "default")
    store = DeviceStore(plane.home / "fleet")
    assert store.authenticate("kiosk-1", creds["secret"])  # the credentials the control plane keeps
    store.close()
    info = verified_target(tmp_path / "tuf", f"{plane.url}/v1/tuf/", repo.root_bytes(), "tiny", "1.1.0",
                           ("kiosk-1", creds["secret"]))
    signed = manifest_of(info)  # what a device verifies: the thresholds and the minimum agent version signed
    assert json.loads(signed["calibration"]) == {"hold_tokens": 8, "max_prompt_tokens": 900}
    assert signed["min_agent_version"] == "0.1.0"
    text = [f(plane, "devices", "add", d, "--group", "kiosks") for f, d in ((remote, "kiosk-2"), (local, "kiosk-3"))]
    assert [r.stdout.splitlines()[0].replace(d, "D") for r, d in zip(text, ("kiosk-2", "kiosk-3"), strict=True)] == [
        "enrolled D (fleet default, groups kiosks); its credentials, shown once: put them in the device's edge.toml "
        "[fleet] section"] * 2

    assigned = [f(plane, "assign", "--group", "kiosks", "tiny@1.0.0") for f in (remote, local)]
    assert assigned[0].returncode == assigned[1].returncode == 0
    assert assigned[0].stdout == assigned[1].stdout == "desired tiny@1.0.0 for 3 device(s): kiosk-1, kiosk-2, kiosk-3\n"
    one = [f(plane, "assign", "kiosk-2", "tiny@1.1.0") for f in (remote, local)]
    assert one[0].stdout == one[1].stdout == "desired tiny@1.1.0 for 1 device(s): kiosk-2\n"

    for args in (["devices"], ["devices", "--json"], ["devices", "--group", "kiosks", "--json"]):
        r, loc = remote(plane, *args), local(plane, *args)
        assert r.returncode == loc.returncode == 0 and r.stdout == loc.stdout, args
    rows = json.loads(local(plane, "devices", "--group", "kiosks", "--json").stdout)
    assert [(d["device"], d["desired"], d["desired_rev"]) for d in rows] == [
        ("kiosk-1", "tiny@1.0.0", 2), ("kiosk-2", "tiny@1.1.0", 4), ("kiosk-3", "tiny@1.0.0", 2)]

    env = {"CASCADE_FLEET_URL": plane.url, "CASCADE_FLEET_ADMIN_KEY": KEY}  # the same, from the environment
    by_env = cascade("fleet", "models", "--json", home=plane.elsewhere, env=env)
    assert by_env.returncode == 0 and by_env.stdout == local(plane, "models", "--json").stdout


@pytest.mark.parametrize("key, says", [("not-the-key", "HTTP 401"), (None, "HTTP 401")], ids=["wrong", "missing"])
def test_a_wrong_or_missing_admin_key_exits_2_with_one_line(plane, key, says):
    for args in (["models"], ["devices"], ["devices", "add", "intruder"], ["assign", "--group", "g", "tiny@1.0.0"],
                 ["push", str(plane.v1), "--name", "tiny", "--version", "9.0.0"]):
        assert says in refused(remote(plane, *args, key=key)), args
    store = DeviceStore(plane.home / "fleet")
    assert store.get("intruder") is None
    store.close()


def test_an_unreachable_or_malformed_url_exits_2_with_one_line(plane):
    closed = f"http://127.0.0.1:{free_port()}"
    assert "cannot reach" in refused(cascade("fleet", "models", "--url", closed, home=plane.elsewhere))
    assert "--url must be" in refused(cascade("fleet", "devices", "--url", "ftp://host", home=plane.elsewhere))


def test_a_bad_file_is_refused_over_http_with_400_and_exit_2(plane):
    readme = REPO / "README.md"
    assert "GGUF magic" in refused(remote(plane, "push", str(readme), "--name", "bad", "--version", "1.0.0"))
    r = loopback.post(f"{plane.url}/v1/fleet/models", params={"name": "bad", "version": "1.0.0"},
                   content=readme.read_bytes(), headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "GGUF magic" in r.json()["error"]["message"]
    assert "uploads" not in r.json()["error"]["message"]  # the server's temporary path is not shown
    for params, param_says in [({"name": "Bad Name", "version": "1.0.0"}, "model name"),
                               ({"name": "bad", "version": "one"}, "semantic")]:
        r = loopback.post(f"{plane.url}/v1/fleet/models", params=params, content=b"GGUF",
                       headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400 and param_says in r.json()["error"]["message"]
    cal = loopback.post(f"{plane.url}/v1/fleet/models", params={"name": "bad", "version": "1.0.0"},
                     content=plane.v1.read_bytes(), headers={"Authorization": f"Bearer {KEY}",
                                                             "X-Cascade-Calibration": "[1, 2]"})
    assert cal.status_code == 400 and cal.json()["error"]["param"] == "X-Cascade-Calibration"
    assert "not a file" in refused(remote(plane, "push", "nope.gguf", "--name", "bad", "--version", "1.0.0"))
    assert "bad" not in [m["name"] for m in json.loads(local(plane, "models", "--json").stdout)]
    assert not any((plane.home / "fleet" / "uploads").glob("*"))  # no upload left behind


def test_a_published_version_is_immutable_over_http(plane, tmp_path):
    first = remote(plane, "push", str(plane.v1), "--name", "frozen", "--version", "1.0.0")
    assert first.returncode == 0, first.stderr
    assert "immutable" in refused(remote(plane, "push", str(plane.v2), "--name", "frozen", "--version", "1.0.0"))
    auth = {"Authorization": f"Bearer {KEY}"}
    url, params = f"{plane.url}/v1/fleet/models", {"name": "frozen", "version": "1.0.0"}
    other = loopback.post(url, params=params, content=plane.v2.read_bytes(), headers=auth)
    assert other.status_code == 409 and other.json()["error"]["code"] == "conflict"
    same = loopback.post(url, params=params, content=plane.v1.read_bytes(), headers=auth)
    assert same.status_code == 200 and same.json()["created"] is False
    new = loopback.post(url, params={"name": "frozen", "version": "1.0.1"}, content=plane.v2.read_bytes(), headers=auth)
    assert new.status_code == 201 and new.json()["created"] is True
    frozen = json.loads(local(plane, "models", "--name", "frozen", "--json").stdout)
    listed = {(m["version"], m["sha256"]) for m in frozen}
    assert listed == {("1.0.0", same.json()["sha256"]), ("1.0.1", new.json()["sha256"])}


def test_refused_operations_exit_2_with_the_reason(plane):
    reg, store = Registry(plane.home / "fleet"), DeviceStore(plane.home / "fleet")
    reg.push(plane.v1, "refusals", "1.0.0")
    store.add("refusal-kiosk", ["refusals"])
    reg.close()
    store.close()
    assert "not published" in refused(remote(plane, "assign", "--group", "refusals", "refusals@9.9.9"))
    assert "no device" in refused(remote(plane, "assign", "nobody", "refusals@1.0.0"))
    assert "no device in group" in refused(remote(plane, "assign", "--group", "nobody", "refusals@1.0.0"))
    assert "enrolled already" in refused(remote(plane, "devices", "add", "refusal-kiosk"))
    assert "must be 1-64 characters" in refused(remote(plane, "devices", "add", "bad id!"))
    auth = {"Authorization": f"Bearer {KEY}"}
    taken = loopback.post(f"{plane.url}/v1/fleet/devices", json={"device": "refusal-kiosk"}, headers=auth)
    missing = loopback.post(f"{plane.url}/v1/fleet/assign", json={"device": "nobody", "model": "refusals@1.0.0"},
                         headers=auth)
    both = loopback.post(f"{plane.url}/v1/fleet/assign", json={"device": "refusal-kiosk", "group": "refusals",
                                                            "model": "refusals@1.0.0"}, headers=auth)
    unknown = loopback.post(f"{plane.url}/v1/fleet/devices", json={"device": "x", "colour": "red"}, headers=auth)
    assert (taken.status_code, missing.status_code, both.status_code, unknown.status_code) == (409, 404, 400, 400)


def test_a_server_side_failure_exits_1(tmp_path):
    class Failing(BaseHTTPRequestHandler):  # a control plane whose every answer is a 500
        def do_GET(self):
            body = json.dumps({"error": {"message": "Internal server error.", "type": "server_error"}}).encode()
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        r = cascade("fleet", "models", "--url", f"http://127.0.0.1:{httpd.server_address[1]}", home=tmp_path)
        assert "HTTP 500" in refused(r, code=1)
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_a_push_streams_a_file_larger_than_one_chunk(plane, tmp_path):
    big = make_gguf(tmp_path / "big.gguf", 4.0)
    with open(big, "ab") as f:
        f.write(os.urandom(3 << 20) + b"\0" * (5 << 20))  # 8 MiB: several chunks each way
    r = remote(plane, "push", str(big), "--name", "big", "--version", "1.0.0", "--json")
    assert r.returncode == 0, r.stderr
    stored = plane.home / "fleet" / "artifacts" / "sha256" / json.loads(r.stdout)["sha256"]
    assert stored.read_bytes() == big.read_bytes()
