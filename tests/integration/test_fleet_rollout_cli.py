"""`cascade fleet rollout ...` on the control plane's own state and with --url against a real
`cascade fleet serve`, and its /v1/fleet/rollouts endpoints: a started rollout is RUNNING with
every execution queued or under way, both modes print the same, pause/resume/abort/rollback move
it and refuse what its state does not allow (exit 2, one line; 409), bad input exits 2 (400/404)
and writes nothing, a refused admin key exits 2, and `fleet devices` names each device's rollout.

No device runs here, so a rollout does not get past its first wave: what is tested is what needs
no device (the controller, when the server runs one, only tells the first wave's devices)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Registry
from model_distribution.rollout.store import RolloutStore
from tests import loopback
from tests.conftest import REPO, Server
from tests.integration.test_fleet_remote import NO_BROKER, cascade, refused
from tests.unit.test_registry import make_gguf

KEY = "rollout-admin-key"
ROLLOUT_ID = re.compile(r"\br-\d+-[0-9a-f]+\b")
GROUPS = ("same", "steer", "http", "refused", "watch", "bad")


@pytest.fixture(scope="module")
def plane(tmp_path_factory):
    """A control plane (HTTP only) with tiny@1.0.0 on five devices in each group and tiny@1.1.0 published."""
    home = tmp_path_factory.mktemp("control-plane")
    root = home / "fleet"
    Repository(root).init()
    files = tmp_path_factory.mktemp("files")
    registry, devices = Registry(root), DeviceStore(root)
    v1, _ = registry.push(make_gguf(files / "v1.gguf", 1.0), "tiny", "1.0.0")
    registry.push(make_gguf(files / "v2.gguf", 2.0), "tiny", "1.1.0")
    for group in GROUPS:
        for i in range(5):
            devices.add(f"{group}-{i}", [group])
        devices.assign(v1, group=group)
    registry.close()
    devices.close()
    s = Server(home, ["fleet", "serve", "--no-broker"], env={"CASCADE_FLEET_SERVER_ADMIN_KEY": KEY, **NO_BROKER})
    s.wait_healthy(60)
    s.home, s.root = home, root
    s.elsewhere = tmp_path_factory.mktemp("operator")  # the operator's machine: no fleet state of its own
    yield s
    s.stop()


def remote(plane, *args, key=KEY):
    return cascade("fleet", "rollout", *args, "--url", plane.url, *(["--admin-key", key] if key else []),
                   home=plane.elsewhere)


def local(plane, *args):
    return cascade("fleet", "rollout", *args, home=plane.home)


def ok(r) -> str:
    assert r.returncode == 0, (r.returncode, r.stdout, r.stderr)
    return r.stdout


def started(r) -> str:
    """The rollout id `rollout start` printed."""
    return ROLLOUT_ID.search(ok(r).splitlines()[0]).group(0)


def auth(key=KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def stored_rollouts(plane) -> list:
    store = RolloutStore(plane.root)
    try:
        return store.list()
    finally:
        store.close()


def same_output(plane, *args) -> str:
    """What local and --url print for ``args``, which must be the same. A controller running in the
    server may still tell the first wave while we read, so a differing pair is read again."""
    for _ in range(5):
        here, there = local(plane, *args), remote(plane, *args)
        if ok(here) == ok(there):
            return here.stdout
        time.sleep(1)
    raise AssertionError(f"{args}: local and remote differ:\n{here.stdout}\n---\n{there.stdout}")


def test_a_started_rollout_is_running_and_both_modes_print_the_same(plane):
    r = remote(plane, "start", "tiny@1.1.0", "--group", "same", "--waves", "20,60,100", "--bake", "2m",
               "--max-failure-rate", "0.02", "--min-executed", "1", "--gate", "escalation_rate<=+0.05",
               "--gate", "error_rate<=+0.01", "--gate", "ttft_p95<=1.2x", "--min-requests", "50")
    rid = started(r)
    assert "20% 1, 60% 2, 100% 2" in r.stdout  # five devices: 1, then 3 in all, then 5
    shown = json.loads(ok(local(plane, "status", rid, "--json")))
    assert (shown["rollout"], shown["model"], shown["group"], shown["state"]) == (rid, "tiny@1.1.0", "same", "RUNNING")
    assert shown["waves"] == [20, 60, 100] and shown["spec"]["bake_s"] == 120 and shown["spec"]["min_requests"] == 50
    assert shown["spec"]["gates"] == ["escalation_rate<=+0.05", "error_rate<=+0.01", "ttft_p95<=1.2x"]
    assert sorted(e["device_id"] for e in shown["executions"]) == [f"same-{i}" for i in range(5)]
    assert {e["state"] for e in shown["executions"]} <= {"QUEUED", "IN_PROGRESS"}
    assert all(e["previous"] == "tiny@1.0.0" for e in shown["executions"]) and shown["decisions"] == []

    text = same_output(plane, "status", rid).splitlines()
    assert rid in text[0] and "RUNNING" in text[0]
    assert [line.split()[:3] for line in text[1:4]] == [["wave", "1", "20%"], ["wave", "2", "60%"],
                                                        ["wave", "3", "100%"]]
    counts = dict(zip(text[4].split()[::2], map(int, text[4].split()[1::2]), strict=True))
    assert list(counts) == ["QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "TIMED_OUT", "REJECTED", "CANCELED",
                            "ROLLED_BACK"]
    assert counts["QUEUED"] + counts["IN_PROGRESS"] == 5
    assert json.loads(same_output(plane, "status", rid, "--json"))["rollout"] == rid
    listed = json.loads(same_output(plane, "list", "--json"))
    assert [(x["rollout"], x["state"]) for x in listed if x["group"] == "same"] == [(rid, "RUNNING")]
    table = same_output(plane, "list").splitlines()
    assert table[0].split() == ["ROLLOUT", "MODEL", "GROUP", "STATE", "WAVE", "STARTED", "REASON"]
    assert any(row.split()[:4] == [rid, "tiny@1.1.0", "same", "RUNNING"] for row in table[1:])

    devices = [cascade("fleet", "devices", "--group", "same", "--json", *flags, home=home) for flags, home in
               ((["--url", plane.url, "--admin-key", KEY], plane.elsewhere), ([], plane.home))]
    rows = json.loads(ok(devices[1]))
    assert json.loads(ok(devices[0])) == rows
    assert [d["rollout"]["id"] for d in rows] == [rid] * 5 and {d["rollout"]["model"] for d in rows} == {"tiny@1.1.0"}
    assert {d["rollout"]["state"] for d in rows} <= {"QUEUED", "IN_PROGRESS"}
    header = ok(cascade("fleet", "devices", "--group", "same", home=plane.home)).splitlines()[0].split()
    assert "ROLLOUT" in header


def test_pause_resume_abort_rollback_and_what_their_state_refuses(plane):
    rid = started(local(plane, "start", "tiny@1.1.0", "--group", "steer"))
    assert "under way" in refused(remote(plane, "start", "tiny@1.1.0", "--group", "steer"))
    assert "PAUSED" in ok(remote(plane, "pause", rid))
    assert "not RUNNING" in refused(local(plane, "pause", rid))
    assert "not RUNNING" in refused(remote(plane, "pause", rid))
    assert "RUNNING" in ok(local(plane, "resume", rid))
    assert "not PAUSED" in refused(remote(plane, "resume", rid))
    assert "ABORTED" in ok(remote(plane, "abort", rid))
    assert "nothing to abort" in refused(local(plane, "abort", rid))
    aborted = json.loads(ok(local(plane, "status", rid, "--json")))
    assert aborted["state"] == "ABORTED" and "QUEUED" not in {e["state"] for e in aborted["executions"]}
    assert "ROLLED_BACK" in ok(local(plane, "rollback", rid))
    assert "rolled back already" in refused(remote(plane, "rollback", rid))
    back = json.loads(ok(remote(plane, "status", rid, "--json")))
    assert back["state"] == "ROLLED_BACK"
    assert {e["state"] for e in back["executions"]} <= {"CANCELED", "ROLLED_BACK"}
    store = DeviceStore(plane.root)
    assert {d.desired for d in store.list(group="steer")} == {"tiny@1.0.0"}  # every device on the old version
    store.close()
    for f in (local, remote):
        assert "no rollout" in refused(f(plane, "pause", "r-0-000000"))
        assert "no rollout" in refused(f(plane, "status", "r-0-000000"))


@pytest.mark.parametrize("args, says", [
    (["tiny@9.9.9", "--group", "bad"], "not published"),
    (["tiny@1.1.0", "--group", "nobody"], "no device in group"),
    (["tiny@1.1.0", "--group", "bad", "--waves", "1,10,50"], "the last 100"),
    (["tiny@1.1.0", "--group", "bad", "--gate", "escalation_rate<0.05"], "is not METRIC"),
    (["tiny@1.1.0", "--group", "bad", "--gate", "latency<=2x"], "unknown metric"),
    (["tiny@1.1.0", "--group", "bad", "--min-executed", "0"], "min executed"),
    (["tiny@1.1.0", "--group", "bad", "--bake", "soon"], "duration 'soon'"),
    (["tiny@1.1.0", "--group", "bad", "--step-timeout", "0"], "step timeout"),
    (["tiny@1.1.0", "--group", "bad", "--max-failure-rate", "2"], "max failure rate"),
    (["tiny@1.1.0", "--group", "bad", "--window", "2am-5am"], "HH:MM-HH:MM"),
    (["tiny@1.1.0", "--group", "bad", "--jitter", "a while"], "duration 'a while'"),
], ids=["unknown-version", "unknown-group", "waves-not-to-100", "malformed-gate", "unknown-metric",
        "min-executed-0", "bake-soon", "no-step-timeout", "failure-rate-over-1", "bad-window", "bad-jitter"])
def test_bad_input_exits_2_with_one_line_and_writes_nothing(plane, args, says):
    before = len(stored_rollouts(plane))
    for f in (local, remote):
        assert says in refused(f(plane, "start", *args)), f.__name__
    assert len(stored_rollouts(plane)) == before


def test_a_refused_admin_key_exits_2_and_writes_nothing(plane):
    before = len(stored_rollouts(plane))
    for key in ("not-the-key", None):
        for args in (["start", "tiny@1.1.0", "--group", "refused"], ["list"], ["status", "r-0-000000"],
                     ["pause", "r-0-000000"], ["rollback", "r-0-000000"]):
            assert "HTTP 401" in refused(remote(plane, *args, key=key)), (key, args)
    assert len(stored_rollouts(plane)) == before


def test_the_http_endpoints_answer_with_their_status_codes(plane):
    url = f"{plane.url}/v1/fleet/rollouts"
    spec = {"model": "tiny@1.1.0", "group": "http", "waves": [50, 100], "bake_s": "1m",
            "gates": ["escalation_rate<=+0.05"], "min_executed": 2}
    for body, code, param in [
        ({**spec, "waves": [1, 10, 50]}, 400, None),
        ({**spec, "gates": ["escalation_rate<0.05"]}, 400, None),
        ({**spec, "min_executed": 0}, 400, None),
        ({**spec, "bake_s": "soon"}, 400, None),
        ({**spec, "max_failure_rate": -1}, 400, None),
        ({**spec, "colour": "red"}, 400, "colour"),
        ({**spec, "min_executed": "many"}, 400, "min_executed"),
        ({"group": "http"}, 400, "model"),
        ({**spec, "model": "tiny"}, 400, None),
        ({**spec, "model": "tiny@9.9.9"}, 404, None),
        ({**spec, "group": "nobody"}, 404, None),
    ]:
        r = loopback.post(url, json=body, headers=auth())
        assert r.status_code == code, (body, r.text)
        error = r.json()["error"]
        assert error["message"] and error["type"] == "invalid_request_error"
        if param:
            assert error["param"] == param, r.text
    for raw in (b"not json", b"[1, 2]"):
        assert loopback.post(url, content=raw, headers=auth()).status_code == 400
    assert not [r for r in stored_rollouts(plane) if r.group == "http"]

    created = loopback.post(url, json=spec, headers=auth())
    assert created.status_code == 201, created.text
    rollout = created.json()
    rid = rollout["rollout"]
    assert (rollout["state"], rollout["group"], rollout["waves"], rollout["spec"]["bake_s"]) == (
        "RUNNING", "http", [50, 100], 60)
    busy = loopback.post(url, json=spec, headers=auth())
    assert busy.status_code == 409 and "under way" in busy.json()["error"]["message"]

    listed = loopback.get(url, headers=auth())
    assert listed.status_code == 200 and rid in [r["rollout"] for r in listed.json()["data"]]
    shown = loopback.get(f"{url}/{rid}", headers=auth()).json()
    assert shown["rollout"] == rid and len(shown["executions"]) == 5 and shown["decisions"] == []
    assert loopback.get(f"{url}/r-0-000000", headers=auth()).status_code == 404

    steps = [("resume", 409), ("pause", 200), ("pause", 409), ("resume", 200), ("abort", 200), ("abort", 409),
             ("pause", 409), ("rollback", 200), ("rollback", 409)]
    for action, code in steps:
        r = loopback.post(f"{url}/{rid}/{action}", headers=auth())
        assert r.status_code == code, (action, r.text)
        assert ("error" in r.json()) == (code != 200)
    assert loopback.post(f"{url}/r-0-000000/pause", headers=auth()).status_code == 404
    for method, path in (("GET", ""), ("POST", ""), ("GET", f"/{rid}"), ("POST", f"/{rid}/pause")):
        assert loopback.request(method, url + path, json=spec, headers=auth("wrong")).status_code == 401
        assert loopback.request(method, url + path, json=spec).status_code == 401


def test_status_watch_redraws_until_the_rollout_stops_running(plane):
    rid = started(local(plane, "start", "tiny@1.1.0", "--group", "watch"))
    watch = subprocess.Popen([sys.executable, "-m", "cascade_cli", "fleet", "rollout", "status", rid, "--watch",
                              "--url", plane.url, "--admin-key", KEY], cwd=REPO, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "CASCADE_HOME": str(plane.elsewhere)})
    try:
        time.sleep(3)
        assert watch.poll() is None  # still running: it watches
        ok(local(plane, "abort", rid))
        out, err = watch.communicate(timeout=30)
    finally:
        if watch.poll() is None:
            watch.kill()
            watch.communicate()
    assert watch.returncode == 0, err
    frames = out.strip().split("\n\n")
    assert "RUNNING" in frames[0].splitlines()[0] and "ABORTED" in frames[-1].splitlines()[0]
    once = ok(local(plane, "status", rid, "--watch"))  # not running: one frame, then it returns
    assert "ABORTED" in once.splitlines()[0] and sum(line.startswith("rollout ") for line in once.splitlines()) == 1
