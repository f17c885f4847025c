"""A rollout's parts on their own: gates, waves, durations, the wave plan, the serving metrics
over a window from telemetry, and the store's compare-and-set."""

from __future__ import annotations

import pytest

from model_distribution.fleet.serving import window_metrics
from model_distribution.rollout.spec import (
    Gate,
    RolloutError,
    RolloutSpec,
    joiner_wave,
    parse_duration,
    parse_waves,
    wave_plan,
)
from model_distribution.rollout.states import ExecutionState
from model_distribution.rollout.store import RolloutStore


@pytest.mark.parametrize("text, kind, bound, op", [
    ("escalation_rate<=+0.05", "delta", 0.05, "<="), ("error_rate<=0.01", "absolute", 0.01, "<="),
    ("ttft_p95<=1.2x", "ratio", 1.2, "<="), ("decode_tps>=0.9x", "ratio", 0.9, ">="),
    (" escalation_rate <= -0.01 ", "delta", -0.01, "<="),
])
def test_gates_parse(text, kind, bound, op):
    g = Gate.parse(text)
    assert (g.kind, g.bound, g.op) == (kind, bound, op)


@pytest.mark.parametrize("text", ["", "escalation_rate", "escalation_rate<0.05", "latency<=1.2x", "ttft_p95<=+1.2x",
                                  "error_rate<=abc", "error_rate<=0.01;drop"])
def test_a_malformed_gate_is_refused_with_the_reason(text):
    with pytest.raises(RolloutError):
        Gate.parse(text)


def test_gates_judge_against_the_control_group():
    assert Gate.parse("escalation_rate<=+0.05").judge(0.24, 0.20)[0] is True
    assert Gate.parse("escalation_rate<=+0.05").judge(0.26, 0.20)[0] is False
    assert Gate.parse("ttft_p95<=1.2x").judge(1.3, 1.0)[0] is False
    assert Gate.parse("decode_tps>=0.9x").judge(95, 100)[0] is True
    assert Gate.parse("error_rate<=0.01").judge(0.02, None)[0] is False  # absolute: no control needed
    assert Gate.parse("ttft_p95<=1.2x").judge(1.0, None)[0] is None  # nothing to compare with
    assert Gate.parse("ttft_p95<=1.2x").judge(None, 1.0)[0] is None


@pytest.mark.parametrize("text", ["1,10,50", "10,1,100", "0,100", "1,1,100", "1,200", "a,100", ""])
def test_waves_must_be_increasing_percentages_ending_at_100(text):
    with pytest.raises(RolloutError):
        parse_waves(text)


def test_durations():
    assert [parse_duration(t) for t in ("90", "90s", "2m", "1h", "0")] == [90, 90, 120, 3600, 0]
    with pytest.raises(RolloutError):
        parse_duration("soon")


def test_a_wave_plan_is_fixed_cumulative_and_never_leaves_a_wave_empty():
    devices = [f"k{i}" for i in range(50)]
    plan = wave_plan("r1", devices, [1, 10, 50, 100])
    counts = [sum(1 for w in plan.values() if w == k) for k in range(4)]
    assert counts == [1, 4, 20, 25] and plan == wave_plan("r1", list(reversed(devices)), [1, 10, 50, 100])
    assert plan != wave_plan("r2", devices, [1, 10, 50, 100])  # another rollout, another order
    assert set(wave_plan("r1", ["only"], [1, 10, 100]).values()) == {0}
    assert all(0 <= joiner_wave("r1", f"new{i}", [1, 10, 50, 100]) <= 3 for i in range(100))


def _record(ts, uptime, cloud, edge, ok, bad, buckets=None, tokens=0, seconds=0.0):
    return {"ts": ts, "uptime_s": uptime, "decisions": {"cloud/hard": cloud, "edge/easy": edge},
            "requests": {"/v1/chat/completions/200": ok, "/v1/chat/completions/503": bad},
            "latency": {"ttft": {"buckets": buckets or {}}}, "decode": {"tokens": tokens, "seconds": seconds}}


def test_window_metrics_take_each_devices_counters_across_the_window_and_a_robust_mean_over_devices():
    a = [_record(90, 90, 10, 10, 20, 0, {"0.1": 5, "1": 20, "+Inf": 20}, 100, 10.0),
         _record(150, 150, 13, 17, 30, 0, {"0.1": 5, "1": 30, "+Inf": 30}, 300, 20.0)]
    b = [_record(120, 20, 2, 8, 9, 1, {"0.1": 10, "1": 10, "+Inf": 10}, 50, 1.0)]  # started inside: all of it counts
    c = [_record(80, 80, 0, 0, 0, 0), _record(140, 140, 1, 3, 4, 0, {"1": 4, "+Inf": 4}, 10, 1.0)]
    m = window_metrics({"a": a, "b": b, "c": c}, 100, 160)
    # a: 3 cloud of 10 decisions, 10 requests, p95 1 s, 20 tok/s; b: 2 of 10, 10 requests with 1 error, p95 0.1 s,
    # 50 tok/s; c: 1 of 4, 4 requests, p95 1 s, 10 tok/s: each metric is the devices' own, weighted by their
    # requests (none weighing more than the median device's 10; three devices: none left out)
    assert m["requests"] == 24 and m["devices"] == 3 and m["escalation_rate"] == pytest.approx(6 / 24)
    assert m["error_rate"] == pytest.approx(1 / 24) and m["error_rate_devices"] == 3
    assert m["ttft_p95"] == pytest.approx(15 / 24) and m["decode_tps"] == pytest.approx(740 / 24)
    assert window_metrics({"a": a}, 200, 300)["requests"] == 0  # nothing in the window
    restarted = [_record(90, 500, 50, 50, 100, 0), _record(150, 30, 1, 1, 2, 0)]  # uptime went back
    assert window_metrics({"c": restarted}, 100, 160)["requests"] == 2


def test_one_device_claiming_a_flood_moves_neither_a_rate_nor_more_than_it_could_have_served():
    from model_distribution.fleet.serving import robust_mean

    assert robust_mean([(1.0, 10**9), (0.0, 10), (0.0, 10)]) == pytest.approx(1 / 3)  # weighs as one device
    assert robust_mean([(1.0, 10**9), (0.0, 10), (0.0, 10), (0.0, 10)]) == 0.0  # four: its extreme left out
    honest = {f"h{i}": [_record(90, 90, 0, 0, 0, 0), _record(150, 150, 1, 9, 10, 0)] for i in range(4)}
    flood = [_record(90, 90, 0, 0, 0, 0), _record(150, 150, 10**6, 0, 0, 10**6)]  # a million errors in a minute
    m = window_metrics({**honest, "liar": flood}, 100, 160)
    # five devices: the liar's extreme is left out, and it weighs no more than a typical device anyway
    assert m["error_rate"] == 0.0 and m["escalation_rate"] == pytest.approx(0.1)
    # what the liar counts toward the traffic total is bounded by what it could have answered in 60 s (+ skew)
    from model_distribution.protocol.device_messages import CLOCK_SKEW_S, MAX_DEVICE_RATE
    assert m["requests"] <= 40 + (60 + CLOCK_SKEW_S) * MAX_DEVICE_RATE


def test_executions_and_rollouts_change_only_from_the_version_read(tmp_path):
    store = RolloutStore(tmp_path)
    spec = RolloutSpec("tiny@1.1.0", "kiosks", [50, 100], gates=["error_rate<=0.01"])
    r = store.create(spec, {"k1": (0, "tiny@1.0.0"), "k2": (1, "tiny@1.0.0")})
    with pytest.raises(RolloutError, match="under way"):
        store.create(spec, {"k1": (0, None)})  # one rollout at a time per group
    e = store.executions(r.rollout_id)[0]
    assert e.state == ExecutionState.QUEUED and store.move(e, ExecutionState.IN_PROGRESS, "assigned", desired_rev=3)
    assert not store.move(e, ExecutionState.CANCELED)  # a stale read (a late abort) does not overwrite
    assert store.executions(r.rollout_id)[0].state == ExecutionState.IN_PROGRESS
    assert store.update(r, wave=1) is not None and store.update(r, wave=0) is None
    assert store.get(r.rollout_id).spec.gates == ["error_rate<=0.01"]
    store.close()


def test_activation_windows_in_local_time_across_midnight():
    import datetime

    from model_distribution.protocol.windows import in_window, seconds_to_window

    at = datetime.datetime(2026, 12, 1, 3, 30)
    assert in_window("02:00-05:00", at) and not in_window("05:00-06:00", at)
    assert in_window("22:00-04:00", at) and not in_window("22:00-03:00", at)
    assert seconds_to_window("02:00-05:00", at) == 0
    assert seconds_to_window("04:00-05:00", at) == 30 * 60
    assert seconds_to_window("01:00-02:00", at) == (21 * 60 + 30) * 60  # tomorrow
    with pytest.raises(RolloutError, match="HH:MM-HH:MM"):
        RolloutSpec("tiny@1.1.0", "kiosks", window="2am-5am")


def test_activation_windows_as_cron_expressions():
    import datetime

    from model_distribution.protocol.windows import in_window, seconds_to_window

    tuesday = datetime.datetime(2026, 12, 1, 3, 30, 20)  # 2026-12-01 is a Tuesday
    assert in_window("* 2-4 * * *", tuesday) and in_window("* 2-4 * * 1-5", tuesday)
    assert not in_window("* 2-4 * * 6,0", tuesday) and not in_window("0-15 3 * * *", tuesday)
    assert seconds_to_window("* 2-4 * * *", tuesday) == 0
    assert seconds_to_window("* 5 * * *", tuesday) == 89 * 60 + 40  # 05:00 today
    assert seconds_to_window("* 2-4 * * 6", tuesday) == ((3 * 24 + 22) * 60 + 29) * 60 + 40  # Saturday 02:00
    assert RolloutSpec("tiny@1.1.0", "kiosks", window="* 2-4 * * 1-5").window == "* 2-4 * * 1-5"
    for bad in ("* 2-4 * *", "0 * 2-4 * * *", "* 25 * * *", "every night"):  # 4 or 6 fields, out of range, words
        with pytest.raises(RolloutError, match="cron"):
            RolloutSpec("tiny@1.1.0", "kiosks", window=bad)
