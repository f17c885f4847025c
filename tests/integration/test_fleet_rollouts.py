"""Staged rollouts end to end: `cascade fleet serve --broker` on a real Mosquitto runs the rollout
controller, and simulated devices in this process run the real device side (DeviceStateClient,
DeviceUpdater: TUF-verified, resumable downloads into their own state_dir) and serve: every
0.5 s each publishes a telemetry record whose counters grow at the escalation rate of the
version it runs, so the serving gates judge real records that came through the broker.

Rollouts are started with the Python API on the control plane's root (the running control plane
picks them up from the database). Fifty devices take a version in four waves, each wave assigned
only once the one before is done; a version signed by an untrusted key halts at wave 1 and rolls
back; a version that escalates more than its control group halts and rolls back with no new
download, and passes with the gate loosened; too little traffic pauses; a device offline during
its wave, a broker restart and a control plane killed with -9 mid-rollout all end with the
rollout complete and nothing half-activated."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cascade_cli.spawn import cascade_command
from model_distribution.device.client import installed
from model_distribution.device.state_client import DeviceStateClient
from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol.topics import topic
from model_distribution.registry.signing import Repository
from model_distribution.registry.store import Manifest, Registry
from model_distribution.rollout.spec import Rollout
from model_distribution.rollout.store import RolloutStore
from tests.conftest import REPO, Server
from tests.integration.test_fleet_devices import SimDevice, check_disk, published, stored_active
from tests.unit.sync.test_mqtt import MOSQUITTO, Mosquitto, wait_until
from tests.unit.test_signing import sign_targets_with_an_untrusted_key

pytestmark = pytest.mark.skipif(MOSQUITTO is None, reason="needs mosquitto (apt-get install mosquitto)")
SERVE_S = 0.5  # a telemetry record this often
PER_RECORD = 10  # requests answered between two records
BASE_RATE, WORSE_RATE = 0.2, 0.4  # escalated share of requests: every version, the worse one
RETRY_S = 0.5  # a cut download is tried again after this (the agent's FleetFollower waits 5 s and more)


class RolloutDevice(SimDevice):
    """A SimDevice that does what the agent's FleetFollower does around the updater (a download
    that was cut is tried again, resuming, until it succeeds or a newer assignment comes), keeps
    the time of each assignment it was told and each report (the waves' order is checked on
    them), goes offline and comes back, and serves: ``serve_once`` publishes one telemetry
    record with cumulative counters."""

    def __init__(self, name: str, secret: str, plane: Plane):
        self.plane, self.secret = plane, secret
        self.timeline: list[tuple[float, str, str]] = []  # (time, "told" or the reported state, name@version)
        self.online = True
        self.started = time.time()
        self.requests = self.escalated = self.records = 0
        super().__init__(name, secret, plane)

    def _desired(self, payload: dict) -> None:
        ref = f"{payload.get('model')}@{payload.get('version')}"
        with self.lock:
            self.timeline.append((time.time(), "told", ref))
        self.plane.on_told(self, ref)  # before the updater sees it
        super()._desired(payload)

    def _report(self, state: dict) -> None:
        with self.lock:
            self.timeline.append((time.time(), state["state"], state["desired"]))
        super()._report(state)

    def _work(self) -> None:
        payload = self._wanted.get()
        while payload is not None:
            while not self._wanted.empty():  # only the newest assignment matters
                payload = self._wanted.get()
                if payload is None:
                    return
            self.updater.apply(payload)
            try:
                payload = self._wanted.get(timeout=RETRY_S if self.updater.retry else None)
            except queue.Empty:
                pass  # the same payload again

    def times(self, what: str, ref: str) -> list[float]:
        with self.lock:
            return [t for t, kind, r in self.timeline if kind == what and r == ref]

    def states_since(self, t0: float) -> list[str]:
        with self.lock:
            return [kind for t, kind, _ in self.timeline if t >= t0 and kind != "told"]

    def go_offline(self) -> None:
        self.online = False
        self.client.stop()

    def come_back(self) -> None:
        """A new connection (the same client id: the broker's persistent session, the retained desired)."""
        self.client = DeviceStateClient(self.plane.broker_url, "default", self.name, self.plane.public_key,
                                        self._desired, self.name, self.secret)
        self.client.start()
        self.online = True

    def serve_once(self, rates: dict[str, float]) -> None:
        if not self.online:
            return
        active = self.updater.active or {}
        self.requests += PER_RECORD
        self.escalated += round(PER_RECORD * rates.get(active.get("sha256"), BASE_RATE))
        self.records += 1
        now = time.time()
        record = {"id": f"{self.name}-{self.records}", "ts": now, "uptime_s": now - self.started,
                  "decisions": {"cloud/hard": self.escalated, "edge/easy": self.requests - self.escalated},
                  "requests": {"/v1/chat/completions/200": self.requests}}
        self.client.link.publish(topic("default", self.name, "telemetry"), json.dumps(record).encode(), qos=1)


@dataclasses.dataclass
class Plane:
    tmp: Path
    home: Path
    broker: Mosquitto
    broker_url: str
    server: Server
    http: str
    root_json: bytes
    public_key: bytes
    repo: Repository
    store: DeviceStore
    registry: Registry
    rollouts: RolloutStore
    v1: Manifest
    v2: Manifest
    downloading: threading.Event = dataclasses.field(default_factory=threading.Event)
    devices: list[RolloutDevice] = dataclasses.field(default_factory=list)
    rates: dict[str, float] = dataclasses.field(default_factory=dict)  # sha256 -> escalated share
    stop_serving: threading.Event = dataclasses.field(default_factory=threading.Event)
    on_told: Callable[[RolloutDevice, str], None] = lambda device, ref: None  # on paho's thread of the device

    def rollout(self, *args: str) -> str:
        """`cascade fleet rollout ARGS --url` against this control plane; its output."""
        out = subprocess.run(cascade_command("fleet", "rollout", *args, "--url", self.http, log_level=None), cwd=REPO,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    def start_rollout(self, *args: str) -> Rollout:
        """`cascade fleet rollout start tiny@1.1.0 --group kiosks ARGS`: the rollout it started."""
        said = self.rollout("start", self.v2.ref, "--group", "kiosks", *args)
        return self.rollouts.get(said.split()[1])  # "rollout r-... started: ..."

    def wait_rollout(self, r: Rollout, state: str, timeout_s: float = 60) -> Rollout:
        def reached():
            now = self.rollouts.get(r.rollout_id)
            assert now.state not in {"SUCCEEDED", "ROLLED_BACK", "ABORTED"} - {state}, (now.state, now.reason)
            return now.state == state

        wait_until(reached, f"rollout {r.rollout_id} {state}", timeout_s)
        return self.rollouts.get(r.rollout_id)

    def waves(self, r: Rollout) -> list[list[RolloutDevice]]:
        wave_of = {e.device_id: e.wave for e in self.rollouts.executions(r.rollout_id)}
        return [[d for d in self.devices if wave_of[d.name] == k] for k in range(len(r.spec.waves))]

    def states(self, r: Rollout) -> dict[str, str]:
        return {e.device_id: e.state for e in self.rollouts.executions(r.rollout_id)}

    def serve(self) -> None:
        while not self.stop_serving.wait(SERVE_S):
            for d in self.devices:
                d.serve_once(self.rates)

    def restart_server(self) -> None:
        """`cascade fleet serve` again on the same home and port (the URL the devices know); the
        repeated --port wins, as argparse takes the last."""
        port = self.server.port
        self.server.stop()  # the process is gone: this only takes it off the live list
        s = Server(self.home, ["fleet", "serve"], "--broker", self.broker_url, "--port", str(port))
        s.port, s.url = port, f"http://127.0.0.1:{port}"
        self.server = s.wait_healthy(60)


@pytest.fixture
def make_plane(tmp_path):
    """A factory: ``make_plane(n, serving=False)`` is the control plane with tiny@1.0.0 and 1.1.0
    published, ``n`` devices of group kiosks connected and ACTIVE on 1.0.0 (assigned before the
    rollout: what a rollback goes back to), and with ``serving`` each one publishing telemetry."""
    made: list[Plane] = []

    def make(n: int, serving: bool = False) -> Plane:
        broker, home, repo, versions = published(tmp_path)
        registry = Registry(home / "fleet")
        store = DeviceStore(home / "fleet")
        secrets_ = {f"k{i:02d}": store.add(f"k{i:02d}", ["kiosks"]) for i in range(n)}
        url = f"mqtt://127.0.0.1:{broker.port}"
        server = Server(home, ["fleet", "serve"], "--broker", url).wait_healthy(60)
        p = Plane(tmp_path, home, broker, url, server, server.url, repo.root_bytes(), repo.desired_public_key(),
                  repo, store, registry, RolloutStore(home / "fleet"), *versions)
        made.append(p)
        p.devices = [RolloutDevice(name, secret, p) for name, secret in secrets_.items()]
        for d in p.devices:
            d.client.start()
        wait_until(lambda: all(d.client.connected.is_set() for d in p.devices), "devices connected", 30)
        store.assign(p.v1, group="kiosks")
        wait_until(lambda: stored_active(p, p.v1), "every device ACTIVE on 1.0.0", 60)
        if serving:
            threading.Thread(target=p.serve, name="serving", daemon=True).start()
        return p

    yield make
    for p in made:
        p.stop_serving.set()
        for d in p.devices:
            d.stop()
        p.server.stop()
        p.broker.stop()
        for db in (p.store, p.registry, p.rollouts):
            db.close()


def converged_on(plane: Plane, m: Manifest) -> None:
    """Every device ACTIVE on ``m`` (as it says and as the control plane stored it, for its newest
    assignment), its models/ only verified files, nothing in staging, ``m`` what it serves next."""
    wait_until(lambda: all(d.active_on(m) for d in plane.devices), f"every device ACTIVE on {m.ref}", 30)
    wait_until(lambda: stored_active(plane, m), f"the control plane stored ACTIVE on {m.ref}", 30)
    for d in plane.devices:
        check_disk(d, m)
        assert installed(d.state_dir)["sha256"] == m.sha256, d.name


def test_fifty_devices_take_a_version_in_four_waves_each_assigned_once_the_one_before_is_done(make_plane):
    plane = make_plane(50)
    r = plane.start_rollout("--waves", "1,10,50,100", "--bake", "0")
    plane.wait_rollout(r, "SUCCEEDED", 60)
    assert set(plane.states(r).values()) == {"SUCCEEDED"} and len(plane.states(r)) == 50
    converged_on(plane, plane.v2)
    waves = plane.waves(r)
    assert [len(w) for w in waves] == [1, 4, 20, 25]
    decisions = plane.rollouts.decisions(r.rollout_id)
    assert [(d["wave"], d["outcome"]) for d in decisions] == [(k, "pass") for k in range(4)]
    for k in range(1, 4):
        last_active = max(d.times("ACTIVE", plane.v2.ref)[0] for d in waves[k - 1])
        first_told = min(d.times("told", plane.v2.ref)[0] for d in waves[k])
        assert last_active < decisions[k - 1]["at"] <= first_told, f"wave {k + 1} was told before wave {k} was done"
    for d in plane.devices:
        assert d.activated == [plane.v1.sha256, plane.v2.sha256], d.name  # one verified activation each


def test_a_version_signed_by_an_untrusted_key_is_refused_by_wave_one_and_rolled_back_before_wave_two(make_plane):
    plane = make_plane(20)
    sign_targets_with_an_untrusted_key(plane.repo)  # after the push: the targets naming 1.1.0 are the attacker's
    r = plane.start_rollout("--waves", "10,50,100", "--bake", "0")
    halted = plane.wait_rollout(r, "ROLLED_BACK", 60)
    assert "install failure rate 1.00" in halted.reason, halted.reason
    first, *later = plane.waves(r)
    assert len(first) == 2
    decision = plane.rollouts.decisions(r.rollout_id)[-1]
    assert (decision["wave"], decision["outcome"], decision["failed"]) == (0, "fail", 2)
    assert any("signed by 0/1 keys" in reason for reason in decision["reasons"]), decision["reasons"]
    states = plane.states(r)
    for d in first:
        assert d.times("REJECTED", plane.v2.ref) and not d.times("DOWNLOADING", plane.v2.ref), d.name
        assert states[d.name] == "ROLLED_BACK"
    for d in (d for wave in later for d in wave):
        assert not d.times("told", plane.v2.ref) and not any(s.get("desired") == plane.v2.ref for s in d.states), \
            f"{d.name} of a later wave had {plane.v2.ref} as its desired version"
        assert states[d.name] == "CANCELED"
    converged_on(plane, plane.v1)  # the first wave told 1.0.0 again (a new revision): still what it serves
    for d in plane.devices:  # later waves fetch ahead, and refused it too
        assert d.activated == [plane.v1.sha256] and not (d.state_dir / "models" / plane.v2.sha256).exists(), d.name


def test_a_version_that_escalates_more_than_its_control_group_rolls_back_without_a_download_and_passes_a_looser_gate(
        make_plane):
    plane = make_plane(20, serving=True)
    plane.rates[plane.v2.sha256] = WORSE_RATE
    gated = ("--waves", "25,100", "--bake", "2", "--min-requests", "20")
    r = plane.start_rollout(*gated, "--gate", "escalation_rate<=+0.05")
    halted = plane.wait_rollout(r, "ROLLED_BACK", 60)
    assert "escalation_rate" in halted.reason, halted.reason
    decision = plane.rollouts.decisions(r.rollout_id)[-1]
    assert decision["outcome"] == "fail" and decision["gates"][0]["passed"] is False
    assert decision["updated"]["escalation_rate"] == pytest.approx(WORSE_RATE)
    assert decision["control"]["escalation_rate"] == pytest.approx(BASE_RATE)
    assert decision["updated"]["requests"] >= 20 and decision["control"]["requests"] >= 20
    updated, control = plane.waves(r)
    assert len(updated) == 5 and not any(d.times("told", plane.v2.ref) for d in control)
    converged_on(plane, plane.v1)
    for d in updated:
        back = max(d.times("told", plane.v1.ref))  # the rollback's assignment
        assert "DOWNLOADING" not in d.states_since(back), (d.name, d.states_since(back))  # models/ kept 1.0.0
        assert d.activated == [plane.v1.sha256, plane.v2.sha256, plane.v1.sha256], d.name

    r2 = plane.start_rollout(*gated, "--gate", "escalation_rate<=+0.5")
    plane.wait_rollout(r2, "SUCCEEDED", 60)
    first = plane.rollouts.decisions(r2.rollout_id)[0]
    assert first["outcome"] == "pass" and first["gates"][0]["passed"] is True
    assert first["updated"]["escalation_rate"] == pytest.approx(WORSE_RATE)
    converged_on(plane, plane.v2)


def test_too_little_traffic_pauses_the_rollout_as_inconclusive_and_resume_takes_it_to_completion(make_plane):
    plane = make_plane(20, serving=True)
    r = plane.start_rollout("--waves", "50,100", "--bake", "1", "--gate", "escalation_rate<=+0.05", "--min-requests",
                             str(10**9))
    paused = plane.wait_rollout(r, "PAUSED", 60)
    assert paused.reason.startswith("inconclusive") and "too little traffic" in paused.reason, paused.reason
    first, second = plane.waves(r)
    time.sleep(1)  # two ticks: it waits for the operator
    assert plane.rollouts.get(r.rollout_id).state == "PAUSED"
    assert not any(d.times("told", plane.v2.ref) for d in second)
    resumes, deadline = 0, time.monotonic() + 60
    while (now := plane.rollouts.get(r.rollout_id)).state != "SUCCEEDED":
        assert time.monotonic() < deadline, f"not SUCCEEDED after 60 s: {now.state} {now.reason}"
        if now.state == "PAUSED":
            assert now.reason.startswith("inconclusive"), now.reason
            plane.rollout("resume", r.rollout_id)
            resumes += 1
        assert now.state in ("RUNNING", "PAUSED"), (now.state, now.reason)
        time.sleep(0.1)
        assert resumes <= 2
    assert resumes == 2  # after each wave: the last one has no control group, but too little traffic still
    assert [d["outcome"] for d in plane.rollouts.decisions(r.rollout_id)] == ["inconclusive", "pass"] * 2
    converged_on(plane, plane.v2)


def test_a_device_offline_during_its_wave_converges_when_it_comes_back_and_a_broker_restart_loses_nothing(
        make_plane):
    plane = make_plane(20)
    r = plane.start_rollout("--waves", "10,50,100", "--bake", "0")
    first, second, third = plane.waves(r)
    late = second[0]
    late.go_offline()  # before its wave is reached (wave 1 must finish first)
    assert not late.times("told", plane.v2.ref)
    wait_until(lambda: all(plane.states(r)[d.name] == "SUCCEEDED" for d in second if d is not late),
               "the rest of wave 2 SUCCEEDED", 60)
    time.sleep(1)  # two ticks
    now = plane.rollouts.get(r.rollout_id)
    assert (now.state, now.wave, plane.states(r)[late.name]) == ("RUNNING", 1, "IN_PROGRESS")  # waits for it
    assert not any(d.times("told", plane.v2.ref) for d in third)
    late.come_back()  # the retained desired document reaches it
    wait_until(lambda: any(d.times("told", plane.v2.ref) for d in third), "wave 3 told", 30)
    plane.broker.stop()  # while wave 3 downloads and reports
    time.sleep(0.5)
    plane.broker.start()
    plane.wait_rollout(r, "SUCCEEDED", 60)
    assert set(plane.states(r).values()) == {"SUCCEEDED"}
    converged_on(plane, plane.v2)
    assert late.times("ACTIVE", plane.v2.ref)[0] > max(d.times("ACTIVE", plane.v2.ref)[0] for d in second
                                                       if d is not late)


def test_a_control_plane_killed_mid_rollout_resumes_it_on_restart_with_nothing_half_activated(make_plane):
    plane = make_plane(20)
    r = plane.start_rollout("--waves", "10,50,100", "--bake", "0")
    second = plane.waves(r)[1]
    killed, once = threading.Event(), threading.Lock()

    def kill(device, ref):  # as wave 2 is told: its devices find no control plane to fetch from
        # each device's MQTT thread calls this; the lock keeps a second one from killing a
        # process that is gone (the error would end that device's MQTT loop)
        with once:
            if device in second and ref == plane.v2.ref and not killed.is_set():
                os.killpg(plane.server.proc.pid, signal.SIGKILL)
                plane.server.proc.wait()
                killed.set()

    plane.on_told = kill
    assert killed.wait(60), "wave 2 was never told"
    time.sleep(1)  # what the devices try meanwhile fails
    was = plane.rollouts.get(r.rollout_id)
    assert (was.state, was.wave) == ("RUNNING", 1), (was.state, was.reason)
    plane.restart_server()
    plane.wait_rollout(r, "SUCCEEDED", 60)
    assert set(plane.states(r).values()) == {"SUCCEEDED"}
    converged_on(plane, plane.v2)
    for d in plane.devices:
        assert d.activated == [plane.v1.sha256, plane.v2.sha256], d.name  # one switch, never half of one
