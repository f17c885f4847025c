"""Issue 36's reproductions that need no broker, each on a real registry database with a fake
clock: a failing rollout never stops another (item 2), one device cannot decide a gate (item 5),
one device is in one rollout at a time (item 9), windows that never open and WAITING forever
(item 10), a future-dated record cannot pin a device's numbers (item 7), nobody locks a device
out (item 16), the calibration travels whole and checked (items 13, 14), a cut GGUF is not
published (item 12), and a signed document cannot be replayed after a restart (item 6)."""

from __future__ import annotations

import json
import math

import pytest

from model_distribution.protocol.device_messages import RefusedMessage, decode
from model_distribution.registry.store import Registry, RegistryError
from model_distribution.rollout.actions import rollback
from model_distribution.rollout.controller import MAX_FAILED_TICKS, start_rollout, tick
from model_distribution.rollout.spec import RolloutConflict, RolloutError, RolloutSpec
from tests.unit.test_registry import make_gguf
from tests.unit.test_rollout_controller import Fleet, finish_wave


@pytest.fixture
def fleet(tmp_path):
    f = Fleet(tmp_path / "fleet", tmp_path)
    yield f
    f.close()


def states(fleet, rid) -> dict[str, str]:
    return {e.device_id: e.state for e in fleet.rollouts.executions(rid)}


# -- item 2: one rollout's failure is its own --------------------------------------------------

def test_a_rollout_whose_step_fails_is_paused_and_never_stops_another_groups(fleet):
    for i in range(4):
        fleet.devices.add(f"b{i}", ["booths"])
    fleet.devices.assign(fleet.v1, group="booths")
    fleet.registry.push(make_gguf(fleet.registry.root / "c.gguf", 3.0), "tiny", "1.2.0")
    broken = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [100]))
    fine = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.2.0", "booths", [100]))
    real = fleet.registry.resolve

    def resolve(ref):  # an injected fault: the kiosks' rollout meets a row no code expected
        if ref == "tiny@1.1.0":
            raise RuntimeError("injected: a row no code expected")
        return real(ref)

    fleet.registry.resolve = resolve
    failures: dict[str, int] = {}
    for _ in range(3):
        fleet.now += 1
        tick(fleet.registry, fleet.devices, fleet.rollouts, fleet.now, failures)
        for d in fleet.devices.list(group="booths"):
            if d.desired == "tiny@1.2.0" and (d.reported or {}).get("state") != "ACTIVE":
                fleet.report(d.device_id, "ACTIVE")
    assert fleet.rollouts.get(fine.rollout_id).state == "SUCCEEDED"  # the other group's went on to the end
    for _ in range(MAX_FAILED_TICKS):
        fleet.now += 1
        tick(fleet.registry, fleet.devices, fleet.rollouts, fleet.now, failures)
    stopped = fleet.rollouts.get(broken.rollout_id)
    assert stopped.state == "PAUSED" and "injected" in stopped.reason and "failed 10 times" in stopped.reason


def test_a_report_with_a_time_past_any_clock_is_refused_before_it_reaches_a_rollout(fleet):
    d = fleet.devices.get("k00")
    for at in (10**20, 1e300, -1, True):
        with pytest.raises(RefusedMessage):
            fleet.devices.report("k00", {"desired": d.desired, "rev": d.desired_rev, "state": "ACTIVE", "at": at})
    with pytest.raises(RefusedMessage, match="64 bits"):
        decode("reported", b'{"state": "ACTIVE", "at": 100000000000000000000}')


# -- item 5: a gate is a statistic over devices --------------------------------------------------

def gated(fleet, lying: bool, gate="error_rate<=+0.05"):
    """Waves 25,100 over 20 devices; the new version fails half its requests; with ``lying`` one
    control device claims a flood of requests, every one an error on the old version."""
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [25, 100], bake_s=60, gates=[gate], min_requests=20))
    fleet.tick()
    updated = fleet.devices_told("tiny@1.1.0")
    control = [d.device_id for d in fleet.devices.list() if d.device_id not in updated]
    liar = control[0] if lying else None
    finish_wave(fleet)
    serve(fleet, updated + control, 0, 0, uptime=1e8)
    fleet.tick()
    fleet.tick(30)
    serve(fleet, updated, 20, 10, uptime=1e8)  # half fail on the new version
    serve(fleet, [d for d in control if d != liar], 20, 0, uptime=1e8)
    if liar:
        serve(fleet, [liar], 10**6 * 30, 10**6 * 30, uptime=1e8)  # a million errors a second, on the old version
    fleet.tick(31)
    return fleet.rollouts.get(r.rollout_id), updated, control


def serve(fleet, devices, requests: int, failed: int, uptime: float):
    for d in devices:
        c = fleet.counters.setdefault(d, {"n": 0, "bad": 0, "id": 0})
        c["n"] += requests
        c["bad"] += failed
        c["id"] += 1
        fleet.devices.telemetry(d, {"id": f"{d}-{c['id']}", "ts": fleet.now, "uptime_s": uptime,
                                    "requests": {"chat/200": c["n"] - c["bad"], "chat/500": c["bad"]},
                                    "decisions": {"edge/confident": c["n"]}})


@pytest.mark.parametrize("lying", [False, True])
def test_one_device_claiming_a_flood_cannot_pass_a_version_its_group_fails(fleet, lying):
    r, updated, control = gated(fleet, lying)
    assert r.state == "ROLLED_BACK", (r.state, r.reason)
    decision = fleet.rollouts.decisions(r.rollout_id)[-1]
    assert decision["updated"]["error_rate"] == pytest.approx(0.5) and decision["control"]["error_rate"] == 0.0
    assert decision["control"]["devices"] == len(control)


def test_the_last_wave_is_compared_with_the_control_group_measured_before_it_never_passed_for_want_of_one(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [100], bake_s=60, gates=["error_rate<=+0.05"]))
    fleet.tick()
    finish_wave(fleet)
    everyone = [d.device_id for d in fleet.devices.list()]
    fleet.tick()
    fleet.tick(30)
    serve(fleet, everyone, 10, 0, uptime=1e8)
    fleet.tick(31)
    paused = fleet.rollouts.get(r.rollout_id)  # one wave and no telemetry from before it: nothing to compare with
    assert paused.state == "PAUSED" and "no value for error_rate" in paused.reason, paused.reason
    assert fleet.rollouts.decisions(r.rollout_id)[-1]["gates"][0]["passed"] is None


def test_a_one_wave_rollout_compares_its_devices_with_themselves_before_it_began(tmp_path):
    fleet = Fleet(tmp_path / "fleet", tmp_path)
    everyone = [d.device_id for d in fleet.devices.list()]
    serve(fleet, everyone, 0, 0, uptime=1e8)
    fleet.now += 200
    serve(fleet, everyone, 20, 0, uptime=1e8)  # healthy on the old version before the rollout
    fleet.now += 10
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [100], bake_s=60, gates=["error_rate<=+0.05"]))
    fleet.tick()
    finish_wave(fleet)
    fleet.tick()
    fleet.tick(30)
    serve(fleet, everyone, 20, 10, uptime=1e8)
    fleet.tick(31)
    halted = fleet.rollouts.get(r.rollout_id)
    assert halted.state == "ROLLED_BACK", halted.reason
    assert "before the rollout began" in fleet.rollouts.decisions(r.rollout_id)[-1]["control_from"]
    fleet.close()


# -- item 9: one device, one rollout under way ----------------------------------------------------

def test_a_device_in_two_groups_gets_one_rollout_at_a_time_and_a_rollback_never_undoes_another(fleet):
    fleet.devices.add("both", ["kiosks", "booths"])
    fleet.devices.assign(fleet.v1, device_id="both")
    v3, _ = fleet.registry.push(make_gguf(fleet.registry.root / "c.gguf", 3.0), "tiny", "1.2.0")
    first = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [100]))
    with pytest.raises(RolloutConflict, match="both in " + first.rollout_id):
        start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.2.0", "booths", [100]))
    fleet.tick()
    finish_wave(fleet)
    fleet.tick()
    fleet.tick()
    assert fleet.rollouts.get(first.rollout_id).state == "SUCCEEDED"
    second = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.2.0", "kiosks", [100]))
    fleet.tick()
    assert fleet.devices.get("both").desired == "tiny@1.2.0"
    with pytest.raises(RolloutConflict, match="another rollout under way"):
        rollback(fleet.registry, fleet.devices, fleet.rollouts, first.rollout_id)
    assert fleet.devices.get("both").desired == "tiny@1.2.0"  # the running rollout's assignment stands
    assert fleet.rollouts.get(second.rollout_id).state == "RUNNING"
    assert v3.ref == "tiny@1.2.0"


# -- item 10: windows that never open -------------------------------------------------------------

@pytest.mark.parametrize("window", ["02:00-02:00", "0 0 31 2 *"])
def test_a_window_that_never_opens_is_refused_up_front(window):
    with pytest.raises(RolloutError, match="never opens"):
        RolloutSpec("tiny@1.1.0", "kiosks", window=window)


def test_waiting_counts_as_word_only_until_the_window_should_have_opened(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [5, 100], window="02:00-03:00", step_timeout_s=600))
    fleet.tick()
    (d,) = fleet.devices_told("tiny@1.1.0")
    for _ in range(30):  # a heartbeat each hour, each saying the window opens in an hour: it never does
        fleet.report(d, "WAITING", window="02:00-03:00", wait_s=3600.0)
        fleet.tick(3600)
        if states(fleet, r.rollout_id)[d] != "IN_PROGRESS":
            break
    assert states(fleet, r.rollout_id)[d] == "TIMED_OUT"
    assert fleet.now - 1000 <= 86400 + 600 + 2 * 3600  # a day (the longest an HH:MM window stays shut), and the timeout


# -- item 7: a device's clock ---------------------------------------------------------------------

def test_a_record_dated_in_the_future_cannot_pin_a_devices_numbers(fleet):
    fleet.devices.telemetry("k00", {"id": "a", "ts": fleet.now + 10 * 86400, "uptime_s": 10.0,
                                    "requests": {"chat/500": 5}})
    fleet.now += 400
    fleet.devices.telemetry("k00", {"id": "b", "ts": fleet.now, "uptime_s": 500.0, "requests": {"chat/200": 7}})
    assert fleet.devices.serving("k00")["requests"] == 7  # the newer record is the device's newest
    for ts in (b"1e999", b"NaN", b"Infinity", b"1" + b"0" * 400):
        with pytest.raises(RefusedMessage):
            decode("telemetry", b'{"id": "t1", "ts": ' + ts + b"}")


# -- item 16: nobody locks a device out ----------------------------------------------------------

def test_the_right_secret_is_taken_from_an_address_throttled_for_wrong_ones(tmp_path):
    from model_distribution.control_plane.credentials import DeviceCredentials
    from model_distribution.fleet.devices import DeviceStore

    store = DeviceStore(tmp_path)
    secret = store.add("d2", [])
    creds = DeviceCredentials(store, ttl_s=0)
    for _ in range(10):
        creds.check("d2", "wrong", "10.0.0.9")
    assert creds.check("d2", "wrong", "10.0.0.9") > 0  # throttled: 429 with the wait
    assert creds.check("d2", secret, "10.0.0.9") is True  # the device itself still gets in
    assert creds.check("d2", "wrong", "10.0.0.10") is False  # another address is counted apart
    store.close()


# -- items 13, 14: the calibration travels whole and checked ----------------------------------------

def test_a_calibration_is_checked_at_push_and_its_difficulty_model_travels_inline(tmp_path):
    model = tmp_path / "calib" / "difficulty.json"
    model.parent.mkdir()
    model.write_text(json.dumps({"weights": {"code": 1.5, "math": -0.5}, "bias": -2.0}))
    edge = tmp_path / "calib" / "edge.toml"  # as cascade calibrate writes it: the model by path, -inf for off
    edge.write_text('[cascade]\ndevice = "calibrating-host"\nhold_tokens = 8\nmin_mean_logprob = -inf\n'
                    'difficulty_threshold = 0.7\ndifficulty_model = "difficulty.json"\n')
    reg = Registry(tmp_path / "fleet")
    m, _ = reg.push(make_gguf(tmp_path / "a.gguf", 1.0), "tiny", "1.0.0", edge)
    assert m.calibration == {"hold_tokens": 8, "min_mean_logprob": None, "difficulty_threshold": 0.7,
                             "difficulty_model": {"weights": {"code": 1.5, "math": -0.5}, "bias": -2.0}}
    json.dumps(m.to_dict(), allow_nan=False)  # what the admin API answers: no infinity, no NaN
    for bad, says in [({"hold_tokens": 0}, "hold_tokens"), ({"mode": "bogus"}, "mode"),
                      ({"difficulty_model": "/home/me/difficulty.json"}, "names a file"),
                      ({"min_token_logprob": math.nan}, "number"), ({"thresholds": 1}, "not a")]:
        with pytest.raises(RegistryError, match=says):
            reg.push(make_gguf(tmp_path / "b.gguf", 2.0), "tiny", "1.1.0", bad)
    reg.close()


def test_the_agent_prepares_a_calibration_before_it_switches_and_refuses_one_it_cannot_apply(tmp_path):
    from cascade.calibration import CalibrationError, CascadeConfig
    from edge_agent.server.fleet import prepare_calibration

    inline = {"weights": {"code": 2.0}, "bias": -1.0}
    config, policy = prepare_calibration(CascadeConfig(min_mean_logprob=-1.0), {
        "sha256": "ab" * 32, "calibration": json.dumps({"min_mean_logprob": None, "difficulty_model": inline})},
        tmp_path)
    assert config.min_mean_logprob == -math.inf and policy.hard.model.weights == {"code": 2.0}
    assert json.loads((tmp_path / "calibration" / f"{'ab' * 32}.json").read_text()) == inline
    for bad in ({"difficulty_model": "/not/on/this/device.json"}, {"hold_tokens": 0}, {"mode": "bogus"}):
        with pytest.raises(CalibrationError):
            prepare_calibration(CascadeConfig(), {"calibration": bad}, tmp_path)


# -- item 12: a cut GGUF is never published ----------------------------------------------------------

def test_a_truncated_or_empty_gguf_is_refused_at_push(tmp_path):
    from model_distribution.artifacts.catalog import Catalog

    real = Catalog(tmp_path).get("smollm2-135m").path.read_bytes()
    reg = Registry(tmp_path / "fleet")
    for i, data in enumerate((real[:8000], b"GGUF" + bytes(1000), real[: len(real) // 2])):
        bad = tmp_path / f"bad{i}.gguf"
        bad.write_bytes(data)
        with pytest.raises(RegistryError, match="not a valid GGUF"):
            reg.push(bad, "tiny", f"1.0.{i}")
    assert reg.models() == []
    reg.close()


# -- item 6: a signed document is not replayed after a restart ------------------------------------------

def test_an_older_document_is_refused_after_a_restart_and_a_stale_one_always(tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from model_distribution.fleet.desired import (
        MAX_AGE_S,
        AppliedDesired,
        BadDocument,
        desired_document,
        verify_desired,
    )
    from model_distribution.fleet.devices import Device

    key = Ed25519PrivateKey.generate()
    public = key.public_key().public_bytes_raw()
    reg = Registry(tmp_path / "fleet")
    m, _ = reg.push(make_gguf(tmp_path / "a.gguf", 1.0), "tiny", "1.0.0")
    doc12 = desired_document(Device("k1", "default", desired_rev=12), m, key, now=1000)
    doc13 = desired_document(Device("k1", "default", desired_rev=13), m, key, now=1010)
    applied = AppliedDesired(tmp_path / "desired.json")
    p13 = verify_desired(doc13, public, "k1", now=1020)
    assert applied.judge(p13) is True
    applied.take(p13)
    restarted = AppliedDesired(tmp_path / "desired.json")  # the device restarts: the order survives
    with pytest.raises(BadDocument, match="replay"):
        restarted.judge(verify_desired(doc12, public, "k1", now=1030))
    assert restarted.judge(verify_desired(doc13, public, "k1", now=1030)) is False  # the same again: nothing new
    with pytest.raises(BadDocument, match="days ago"):
        verify_desired(doc13, public, "k1", now=1010 + MAX_AGE_S + 1)
    # a control plane whose database was restored signs a lower revision later: taken
    doc5 = desired_document(Device("k1", "default", desired_rev=5), m, key, now=2000)
    assert restarted.judge(verify_desired(doc5, public, "k1", now=2000)) is True
    reg.close()


# -- the inbox: no device's flood reaches another's messages ---------------------------------------

def test_a_flooding_device_loses_its_own_excess_only_and_its_last_state_is_kept(tmp_path):
    from prometheus_client import CollectorRegistry

    from model_distribution.control_plane.inbox import DeviceInbox
    from model_distribution.fleet.devices import DeviceStore

    clock = [0.0]
    store, metrics = DeviceStore(tmp_path), CollectorRegistry()
    for d in ("noisy", "quiet"):
        store.add(d, [])
    inbox = DeviceInbox(store, metrics, rate=2.0, burst=5.0, clock=lambda: clock[0])
    outcomes, quiet = [], []
    for i in range(100):
        record = json.dumps({"id": f"n{i}", "ts": 1.0, "uptime_s": 1.0})
        state = json.dumps({"state": "ACTIVE", "rev": i})
        outcomes.append(inbox.handle("default", "noisy", "telemetry", record.encode()))
        outcomes.append(inbox.handle("default", "noisy", "reported", state.encode()))
        if i % 50 == 0:  # the quiet device, at its own pace, meanwhile
            quiet.append(inbox.handle("default", "quiet", "telemetry", record.replace("n", "q").encode()))
        clock[0] += 0.01  # 200 messages in a second from the noisy one
    assert quiet == ["recorded", "recorded"]  # its own bucket: nothing of the flood reaches it
    kept = outcomes.count("recorded")
    assert 5 <= kept <= 5 + 2 + 1  # the burst and a second's refill, no more
    assert outcomes.count("held") + outcomes.count("rate") + kept == 200
    assert metrics.get_sample_value("cascade_fleet_device_messages_refused_total",
                                    {"kind": "telemetry", "reason": "rate"}) == outcomes.count("rate") > 90
    assert inbox.flush() == 1 and store.get("noisy").reported["rev"] == 99  # its latest state, kept
    assert inbox.handle("default", "quiet", "reported", b'{"state":"ACTIVE","rev":1}') == "recorded"
    assert inbox.handle("default", "nobody", "reported", b"{}") == "unknown_device"
    assert inbox.handle("other-fleet", "quiet", "reported", b"{}") == "unknown_device"
    store.close()


def test_a_device_keeps_at_most_its_share_of_records_whatever_times_it_gives_them(tmp_path, monkeypatch):
    """The attacker's bypass: every record with the same time, so a cut by time deleted nothing."""
    from model_distribution.fleet import devices as devices_module
    from model_distribution.fleet.devices import DeviceStore

    monkeypatch.setattr(devices_module, "MAX_RECORDS_PER_DEVICE", 50)
    store = DeviceStore(tmp_path)
    store.add("evil", [])
    for i in range(1000):
        assert store.telemetry("evil", {"id": f"e{i}", "ts": 1000.0, "uptime_s": 10.0})
    kept = store._db.execute("SELECT count(*) FROM telemetry WHERE device_id = 'evil'").fetchone()[0]
    assert kept <= 50 + 500  # cut back to its share every 500 records
    store.close()


def _gguf(path, arch="llama", context=None):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    if context is not None:
        w.add_key_value(f"{arch}.context_length", *context)
    w.add_tensor("t", np.zeros((4, 32), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("arch, context, says", [
    ("a" * 6_000_000, None, "architecture"),  # it went into every device's targets metadata: past 5 MB, none installed
    ("llama", (2048.0, "FLOAT32"), "context length"),  # crashed the signing: listed, never signed
    ("llama", (float("nan"), "FLOAT32"), "context length"),
    ("llama", (2**64 - 1, "UINT64"), "context length"),  # crashed SQLite
])
def test_a_file_whose_header_cannot_be_a_signed_manifest_is_refused_and_nothing_is_listed(tmp_path, arch, context,
                                                                                        says):
    import gguf

    from model_distribution.fleet import operations
    from model_distribution.registry.signing import Repository

    if context is not None:
        context = (context[0], getattr(gguf.GGUFValueType, context[1]))
    bad = _gguf(tmp_path / "bad.gguf", arch, context)
    repo = Repository(tmp_path / "fleet")
    repo.init()
    reg = Registry(tmp_path / "fleet")
    with pytest.raises(RegistryError, match=says):
        operations.push(reg, repo, bad, "tiny", "1.0.0")
    assert reg.models() == [] and not repo.has_target("tiny", "1.0.0")
    reg.close()


# -- what the attacker helper reproduced (its report's defects 4, 5, 9, 10, 11) ------------------------

def test_repeating_the_same_progress_is_no_word_and_the_step_timeout_applies(fleet):
    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [5, 100], step_timeout_s=5))
    fleet.tick()
    (d,) = fleet.devices_told("tiny@1.1.0")
    for _ in range(20):  # "DOWNLOADING 1%" with a fresh time, twice a second
        fleet.report(d, "DOWNLOADING", done=10, total=1000)
        fleet.tick(0.5)
    stopped = fleet.rollouts.get(r.rollout_id)  # it timed out, and the install failure gate (0) rolled back
    assert stopped.state == "ROLLED_BACK" and "failure rate" in stopped.reason, stopped.reason
    assert "no word" in " ".join(fleet.rollouts.decisions(r.rollout_id)[-1]["reasons"])


def test_a_tiny_decode_time_gives_no_speed_and_no_infinity_reaches_a_decision(fleet):
    from model_distribution.rollout.commands import status

    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts,
                      RolloutSpec("tiny@1.1.0", "kiosks", [25, 100], bake_s=10, gates=["decode_tps>=0.9x"]))
    fleet.tick()
    finish_wave(fleet)
    for d in (d.device_id for d in fleet.devices.list()):
        fleet.devices.telemetry(d, {"id": f"{d}-a", "ts": fleet.now, "uptime_s": 100.0})
    fleet.tick()
    fleet.tick(5)
    for d in (d.device_id for d in fleet.devices.list()):
        fleet.devices.telemetry(d, {"id": f"{d}-b", "ts": fleet.now, "uptime_s": 105.0,
                                    "decode": {"tokens": 1000, "seconds": 5e-324}})
    fleet.tick(6)
    shown = status(fleet.rollouts, r.rollout_id)
    json.dumps(shown, allow_nan=False)  # what GET /v1/fleet/rollouts/{id} answers: strict JSON
    assert shown["decisions"][-1]["updated"]["decode_tps"] is None


def test_a_record_without_uptime_is_refused_and_a_first_record_counts_no_more_than_its_window(fleet):
    from model_distribution.fleet.serving import window_metrics

    with pytest.raises(RefusedMessage, match="uptime_s"):
        fleet.devices.telemetry("k00", {"id": "x", "ts": fleet.now, "requests": {"chat/200": 2**53}})
    first = {"id": "y", "ts": 1010.0, "uptime_s": 1e9, "requests": {"chat/200": 1e12}}  # "up for 31 years"
    m = window_metrics({"k00": [first]}, 1000.0, 1060.0)
    assert m["requests"] <= (60 + 300) * 1000  # the window, plus the clock's allowance, at 1,000 a second


def test_invisible_format_characters_are_refused_like_control_characters():
    for text in ("ok\\u202e DELIAF ton", "a\\u200bb", "x\\u2066y", "\\ufeffz"):
        with pytest.raises(RefusedMessage, match="control"):
            decode("reported", ('{"state": "FAILED", "reason": "' + text + '"}').encode())


def test_invented_names_neither_fill_the_throttle_nor_lift_a_devices(tmp_path):
    from model_distribution.control_plane.credentials import DeviceCredentials
    from model_distribution.fleet.devices import DeviceStore

    store = DeviceStore(tmp_path)
    store.add("d1", [])
    creds = DeviceCredentials(store, ttl_s=0, max_pairs=1000)
    for _ in range(11):
        creds.check("d1", "wrong", "10.0.0.9")
    for i in range(5000):
        assert creds.check(f"nobody-{i}", "wrong", "10.0.0.9") is False
    assert creds.check("d1", "wrong", "10.0.0.9") > 0  # still throttled
    store.close()


def test_an_aborted_rollouts_executions_are_not_left_in_progress(fleet):
    """Item 17: after an abort no one follows an execution, so none may stay IN_PROGRESS for good."""
    from model_distribution.rollout.actions import abort
    from model_distribution.rollout.commands import device_rows

    r = start_rollout(fleet.registry, fleet.devices, fleet.rollouts, RolloutSpec("tiny@1.1.0", "kiosks", [10, 100]))
    fleet.tick()
    told = fleet.devices_told("tiny@1.1.0")
    fleet.report(told[0], "DOWNLOADING", done=1, total=10)
    fleet.tick()
    abort(fleet.rollouts, r.rollout_id, fleet.devices)
    assert "IN_PROGRESS" not in set(states(fleet, r.rollout_id).values())
    shown = {row["device"]: row["rollout"]["state"] for row in device_rows(fleet.devices, fleet.rollouts)}
    assert {shown[d] for d in told} == {"CANCELED"} and fleet.devices.get(told[0]).desired == "tiny@1.1.0"
