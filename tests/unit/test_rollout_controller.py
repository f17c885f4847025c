"""The rollout controller's decisions, tick by tick, on a real registry database: devices report
by writing their reported state and telemetry into the store as the MQTT side does, with the
clock given to each tick. Waves in order, the install failure gate, a serving gate against the
control group, too little traffic, timeouts, late reports, joiners, operator commands."""

from __future__ import annotations

import pytest

from model_distribution.fleet.devices import DeviceStore
from model_distribution.registry.store import Registry
from model_distribution.rollout.actions import abort, pause, resume, rollback
from model_distribution.rollout.controller import start_rollout, tick
from model_distribution.rollout.spec import RolloutError, RolloutSpec
from model_distribution.rollout.store import RolloutStore
from tests.unit.test_registry import make_gguf

N = 20


class Fleet:
    def __init__(self, root, tmp_path):
        self.now = 1000.0
        self.registry, self.rollouts = Registry(root), RolloutStore(root, clock=lambda: self.now)
        self.devices = DeviceStore(root, clock=lambda: self.now)  # a device's times are bounded by this clock
        self.v1, _ = self.registry.push(make_gguf(tmp_path / "a.gguf", 1.0), "tiny", "1.0.0")
        self.v2, _ = self.registry.push(make_gguf(tmp_path / "b.gguf", 2.0), "tiny", "1.1.0")
        for i in range(N):
            self.devices.add(f"k{i:02d}", ["kiosks"])
        self.devices.assign(self.v1, group="kiosks")
        self.now = 1000.0
        self.counters: dict[str, dict] = {}

    def tick(self, dt: float = 1.0):
        self.now += dt
        tick(self.registry, self.devices, self.rollouts, self.now)

    def report(self, device: str, state: str, **extra):
        d = self.devices.get(device)
        self.devices.report(device, {"desired": d.desired, "rev": d.desired_rev, "state": state, "at": self.now,
                                     **extra})

    def devices_told(self, ref: str) -> list[str]:
        return [d.device_id for d in self.devices.list() if d.desired == ref]

    def serve(self, devices, requests: int, escalated: int):
        """Each device answers ``requests`` more, ``escalated`` of them by the cloud; one telemetry record."""
        for d in devices:
            c = self.counters.setdefault(d, {"n": 0, "cloud": 0, "id": 0})
            c["n"] += requests
            c["cloud"] += escalated
            c["id"] += 1
            self.devices.telemetry(d, {"id": f"{d}-{c['id']}", "ts": self.now, "uptime_s": self.now,
                                       "decisions": {"cloud/x": c["cloud"], "edge/y": c["n"] - c["cloud"]},
                                       "requests": {"/v1/chat/completions/200": c["n"]}})

    def status(self, rid):
        return self.rollouts.get(rid)

    def close(self):
        self.registry.close()
        self.devices.close()
        self.rollouts.close()


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path / "fleet", tmp_path)
    yield f
    f.close()


def finish_wave(fleet, state="ACTIVE"):
    for d in fleet.devices_told("tiny@1.1.0"):
        if (fleet.devices.get(d).reported or {}).get("state") != state:
            fleet.report(d, state, **({"reason": "its signed metadata was refused"} if state == "REJECTED" else {}))


def test_waves_go_in_order_and_the_rollout_completes(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [5, 25, 100], bake_s=10))
    sizes = []
    for _ in range(3):
        fleet.tick()
        sizes.append(len(fleet.devices_told("tiny@1.1.0")))
        finish_wave(fleet)
        fleet.tick()  # the wave is done: the bake starts
        fleet.tick(5)
        assert len(fleet.devices_told("tiny@1.1.0")) == sizes[-1]  # baking: the next wave waits
        fleet.tick(6)
    assert sizes == [1, 5, 20]
    done = fleet.status(r.rollout_id)
    assert done.state == "SUCCEEDED"
    assert {e.state for e in fleet.rollouts.executions(r.rollout_id)} == {"SUCCEEDED"}
    assert [d["outcome"] for d in fleet.rollouts.decisions(r.rollout_id)] == ["pass"] * 3


def test_a_version_every_first_wave_device_refuses_halts_and_rolls_back_before_wave_two(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [10, 50, 100], max_failure_rate=0.02, min_executed=2))
    fleet.tick()
    first = fleet.devices_told("tiny@1.1.0")
    assert len(first) == 2
    finish_wave(fleet, "REJECTED")
    fleet.tick()
    fleet.tick()
    halted = fleet.status(r.rollout_id)
    assert halted.state == "ROLLED_BACK" and "failure rate 1.00" in halted.reason
    assert fleet.devices_told("tiny@1.1.0") == []  # the two went back to 1.0.0; nobody else was told
    states = {e.device_id: e.state for e in fleet.rollouts.executions(r.rollout_id)}
    assert {states[d] for d in first} == {"ROLLED_BACK"} and list(states.values()).count("CANCELED") == N - 2
    decision = fleet.rollouts.decisions(r.rollout_id)[-1]
    assert decision["outcome"] == "fail" and decision["failed"] == 2 and decision["reasons"]


def rollout_with_gate(fleet, gate: str, min_requests: int = 20):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [25, 100], bake_s=60, gates=[gate],
                                  min_requests=min_requests))
    fleet.tick()
    updated = fleet.devices_told("tiny@1.1.0")
    control = [d.device_id for d in fleet.devices.list() if d.device_id not in updated]
    finish_wave(fleet)
    fleet.serve(updated + control, 0, 0)  # the counters as the bake starts
    fleet.tick()
    return r, updated, control


def test_a_worse_escalation_rate_than_the_control_group_halts_and_rolls_back(fleet):
    r, updated, control = rollout_with_gate(fleet, "escalation_rate<=+0.05")
    fleet.tick(30)
    fleet.serve(updated, 10, 4)  # 40% escalated on the new version
    fleet.serve(control, 10, 2)  # 20% on the old
    fleet.tick(31)
    halted = fleet.status(r.rollout_id)
    assert halted.state == "ROLLED_BACK" and "escalation_rate" in halted.reason
    decision = fleet.rollouts.decisions(r.rollout_id)[-1]
    assert decision["updated"]["escalation_rate"] == pytest.approx(0.4)
    assert decision["control"]["escalation_rate"] == pytest.approx(0.2)
    assert fleet.devices_told("tiny@1.1.0") == []


def test_the_same_version_with_the_gate_loosened_passes(fleet):
    r, updated, control = rollout_with_gate(fleet, "escalation_rate<=+0.25")
    fleet.tick(30)
    fleet.serve(updated, 10, 4)
    fleet.serve(control, 10, 2)
    fleet.tick(31)
    assert fleet.status(r.rollout_id).wave == 1 and fleet.status(r.rollout_id).state == "RUNNING"
    assert fleet.rollouts.decisions(r.rollout_id)[-1]["gates"][0]["passed"] is True


def test_too_little_traffic_pauses_as_inconclusive_and_resume_goes_on(fleet):
    r, updated, control = rollout_with_gate(fleet, "escalation_rate<=+0.05", min_requests=1000)
    fleet.tick(30)
    fleet.serve(updated, 1, 0)
    fleet.serve(control, 1, 0)
    fleet.tick(31)
    paused = fleet.status(r.rollout_id)
    assert paused.state == "PAUSED" and paused.reason.startswith("inconclusive")
    assert "too little traffic" in paused.reason
    fleet.tick(100)
    assert fleet.status(r.rollout_id).state == "PAUSED"  # waits for the operator
    resume(fleet.rollouts, r.rollout_id)
    fleet.tick()
    assert fleet.status(r.rollout_id).wave == 1 and len(fleet.devices_told("tiny@1.1.0")) == N


def test_a_device_that_goes_quiet_times_out_and_a_late_report_does_not_undo_it(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [10, 100], step_timeout_s=60, max_failure_rate=0.5,
                                  min_executed=2))
    fleet.tick()
    quiet, talking = fleet.devices_told("tiny@1.1.0")
    fleet.report(talking, "ACTIVE")
    fleet.report(quiet, "DOWNLOADING", done=10, total=100)
    fleet.tick()
    assert {e.device_id: e.detail for e in fleet.rollouts.executions(r.rollout_id)}[quiet] == "DOWNLOADING 10%"
    fleet.tick(61)
    states = {e.device_id: e.state for e in fleet.rollouts.executions(r.rollout_id)}
    assert states[quiet] == "TIMED_OUT"
    fleet.report(quiet, "ACTIVE")  # too late
    fleet.tick()
    assert {e.device_id: e.state for e in fleet.rollouts.executions(r.rollout_id)}[quiet] == "TIMED_OUT"


def test_a_failure_the_device_tries_again_stays_in_progress_and_only_progress_holds_off_the_timeout(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [15, 100], step_timeout_s=60))
    fleet.tick()
    cut, gone, broken = fleet.devices_told("tiny@1.1.0")
    for d in (cut, gone):  # the control plane restarted under their downloads: they try again
        fleet.report(d, "FAILED", reason="the download was cut", retry=True)
    fleet.report(broken, "FAILED", reason="activation failed", retry=False)
    fleet.tick()
    ex = {e.device_id: e for e in fleet.rollouts.executions(r.rollout_id)}
    assert ex[cut].state == ex[gone].state == "IN_PROGRESS" and ex[cut].detail.startswith("retrying")
    assert ex[broken].state == "FAILED"  # no retry: final
    fleet.tick(30)
    fleet.report(cut, "DOWNLOADING", done=50, total=100)  # the retry makes progress
    fleet.report(gone, "FAILED", reason="the download was cut", retry=True)  # it only tries again
    fleet.tick()
    fleet.tick(31)
    states = {e.device_id: e.state for e in fleet.rollouts.executions(r.rollout_id)}
    assert (states[cut], states[gone]) == ("IN_PROGRESS", "TIMED_OUT")
    assert fleet.status(r.rollout_id).wave_done_at is None  # the wave waits for the device still trying
    fleet.report(cut, "ACTIVE")
    fleet.tick()
    assert {e.device_id: e.state for e in fleet.rollouts.executions(r.rollout_id)}[cut] == "SUCCEEDED"


def test_a_report_of_an_earlier_assignment_does_not_count(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [5, 100]))
    fleet.tick()
    (d,) = fleet.devices_told("tiny@1.1.0")
    fleet.devices.report(d, {"desired": "tiny@1.0.0", "rev": 1, "state": "ACTIVE", "at": fleet.now})
    fleet.tick()
    assert {e.device_id: e.state for e in fleet.rollouts.executions(r.rollout_id)}[d] == "IN_PROGRESS"


def test_a_device_joining_the_group_mid_rollout_gets_the_version_with_its_wave(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [5, 100]))
    fleet.devices.add("late", ["kiosks"])
    fleet.devices.assign(fleet.v1, device_id="late")
    for _ in range(2):
        fleet.tick()
        finish_wave(fleet)
        fleet.tick()
        fleet.tick()
    assert fleet.status(r.rollout_id).state == "SUCCEEDED"
    assert "late" in fleet.devices_told("tiny@1.1.0")


def test_operator_commands(fleet):
    spec = RolloutSpec("tiny@1.1.0", "kiosks", [5, 50, 100])
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, spec)
    with pytest.raises(RolloutError, match="under way"):
        start_rollout(fleet.registry, fleet.devices, fleet.rollouts, spec)
    fleet.tick()
    pause(fleet.rollouts, r.rollout_id)
    finish_wave(fleet)
    fleet.tick()
    fleet.tick()
    assert len(fleet.devices_told("tiny@1.1.0")) == 1  # paused: no new wave
    with pytest.raises(RolloutError):
        pause(fleet.rollouts, r.rollout_id)
    resume(fleet.rollouts, r.rollout_id)
    for _ in range(3):  # the wave is done, it passes, the next wave is told
        fleet.tick()
    assert len(fleet.devices_told("tiny@1.1.0")) == 10
    rollback(fleet.registry, fleet.devices, fleet.rollouts, r.rollout_id)
    assert fleet.devices_told("tiny@1.1.0") == [] and fleet.status(r.rollout_id).state == "ROLLED_BACK"
    r2 = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, spec)  # the group is free again
    abort(fleet.rollouts, r2.rollout_id, fleet.devices)
    fleet.tick()
    assert fleet.status(r2.rollout_id).state == "ABORTED" and fleet.devices_told("tiny@1.1.0") == []


@pytest.mark.parametrize("spec, says", [
    (RolloutSpec("tiny@9.9.9", "kiosks"), "not published"),
    (RolloutSpec("tiny@1.1.0", "nobody"), "no device in group"),
])
def test_bad_rollouts_are_refused_and_write_nothing(fleet, spec, says):
    from model_distribution.registry.store import RegistryError

    with pytest.raises(RegistryError, match=says):
        start_rollout(fleet.registry, fleet.devices, fleet.rollouts, spec)
    assert fleet.rollouts.list() == []


def test_a_group_with_a_device_that_has_no_version_to_go_back_to_is_refused(fleet):
    fleet.devices.add("fresh", ["kiosks"])
    with pytest.raises(RolloutError, match="no assigned version to roll back to"):
        start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks"))


def test_later_waves_fetch_ahead_and_a_rollback_stops_that(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [10, 100], window="02:00-05:00", jitter_s=30))
    fleet.tick()
    told = fleet.devices_told("tiny@1.1.0")
    ahead = [d for d in fleet.devices.list() if d.prefetch == "tiny@1.1.0"]
    assert len(told) == 2 and len(ahead) == N - 2 and not {d.device_id for d in ahead} & set(told)
    assert {(d.window, d.jitter_s) for d in fleet.devices.list() if d.device_id in told} == {("02:00-05:00", 30.0)}
    fleet.report(told[0], "WAITING", window="02:00-05:00")  # downloaded, waits for its window: still in progress
    fleet.tick()
    assert {e.device_id: e.state for e in fleet.rollouts.executions(r.rollout_id)}[told[0]] == "IN_PROGRESS"
    rollback(fleet.registry, fleet.devices, fleet.rollouts, r.rollout_id)
    assert [d for d in fleet.devices.list() if d.prefetch] == []


def test_only_the_next_wave_fetches_ahead(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [10, 50, 100]))
    fleet.tick()
    waves = {e.device_id: e.wave for e in fleet.rollouts.executions(r.rollout_id)}
    ahead = {d.device_id for d in fleet.devices.list() if d.prefetch == "tiny@1.1.0"}
    first = fleet.rollouts.get(r.rollout_id).wave
    assert ahead and ahead == {d for d, w in waves.items() if w == first + 1}  # the first runs, the second fetches
    for d in fleet.devices_told("tiny@1.1.0"):
        fleet.report(d, "ACTIVE")
    fleet.tick()
    fleet.tick()
    assert fleet.rollouts.get(r.rollout_id).wave == first + 1
    fleet.tick()  # the second wave is told to switch
    ahead = {d.device_id for d in fleet.devices.list() if d.prefetch == "tiny@1.1.0"}
    assert ahead and ahead == {d for d, w in waves.items() if w == first + 2}  # and now the third


def test_the_desired_document_carries_the_window_the_jitter_and_what_to_fetch_ahead(fleet):
    import json

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from model_distribution.fleet.desired import desired_document, verify_desired

    key = Ed25519PrivateKey.generate()
    fleet.devices.prefetch(fleet.v2, ["k00"], jitter_s=5)
    d = fleet.devices.get("k00")
    public = key.public_key().public_bytes_raw()
    payload = verify_desired(desired_document(d, fleet.v1, key, fleet.v2), public, "k00")
    assert payload["prefetch"]["sha256"] == fleet.v2.sha256 and payload["jitter_s"] == 5 and "window" not in payload
    fleet.devices.assign(fleet.v2, device_id="k00", window="22:00-04:00")
    d = fleet.devices.get("k00")
    assert d.prefetch is None  # assigned what it fetched ahead: done with
    payload = verify_desired(desired_document(d, fleet.v2, key), public, "k00")
    assert payload["window"] == "22:00-04:00" and "prefetch" not in payload
    assert json.loads(json.dumps(payload))["rev"] == d.desired_rev


def test_a_rollback_that_lands_while_a_tick_assigns_wins(fleet):
    """An operator's rollback in another process between a tick's read and its claim: the claim
    fails and nothing is told; between the claim and the assignment: the rollback sends the
    claimed device back and the tick does not tell it the new version."""
    from model_distribution.rollout.controller import _assign

    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [10, 100]))
    stale = [e for e in fleet.rollouts.executions(r.rollout_id) if e.wave == 0]
    claimed = stale[1]
    assert fleet.rollouts.move(claimed, "IN_PROGRESS", "assigning", fleet.now)  # a tick claimed this one
    rollback(fleet.registry, fleet.devices, fleet.rollouts, r.rollout_id)
    _assign([stale[0]], fleet.v2, fleet.status(r.rollout_id), fleet.registry, fleet.devices, fleet.rollouts, fleet.now)
    claimed_now = fleet.rollouts.execution(r.rollout_id, claimed.device_id)
    _assign([claimed_now], fleet.v2, r, fleet.registry, fleet.devices, fleet.rollouts, fleet.now)
    assert fleet.devices_told("tiny@1.1.0") == []
    states = {e.device_id: e.state for e in fleet.rollouts.executions(r.rollout_id)}
    assert states[stale[0].device_id] == "CANCELED" and states[claimed.device_id] == "ROLLED_BACK"


def test_a_gate_with_traffic_but_no_value_pauses_instead_of_passing(fleet):
    r, updated, control = rollout_with_gate(fleet, "ttft_p95<=1.2x")  # the records carry no TTFT buckets
    fleet.tick(30)
    fleet.serve(updated, 10, 2)
    fleet.serve(control, 10, 2)
    fleet.tick(31)
    paused = fleet.status(r.rollout_id)
    assert paused.state == "PAUSED" and "no value for ttft_p95" in paused.reason


def test_a_paused_rollout_of_one_group_never_blocks_another_group(fleet):
    for i in range(4):
        fleet.devices.add(f"lobby-{i}", ["lobby"])
    fleet.devices.assign(fleet.v1, group="lobby")
    kiosks = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [5, 100]))
    pause(fleet.rollouts, kiosks.rollout_id)
    lobby = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "lobby", [50, 100]))
    for _ in range(2):
        fleet.tick()
        finish_wave(fleet)
        fleet.tick()
        fleet.tick()
    assert fleet.status(lobby.rollout_id).state == "SUCCEEDED"
    assert fleet.status(kiosks.rollout_id).state == "PAUSED"
    assert sorted(d for d in fleet.devices_told("tiny@1.1.0") if not d.startswith("lobby")) == []
