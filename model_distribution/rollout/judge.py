"""A wave's judgement: the install failure gate over the devices reached, then the serving gates,
each a robust mean over the devices of each side (fleet/serving.py), the updated devices against a control:
the devices not yet updated over the same window; at the last wave, the control group the wave
before was judged against; in a rollout of one wave, the same devices before it began. With no
control a relative gate is inconclusive, never a pass for want of data."""

from __future__ import annotations

from model_distribution.fleet.devices import DeviceStore
from model_distribution.fleet.serving import window_metrics
from model_distribution.rollout.spec import Execution, Rollout
from model_distribution.rollout.states import DONE, FAILURES, ExecutionState
from model_distribution.rollout.store import RolloutStore

BASELINE_MIN_S = 300.0  # a one-wave rollout's relative gates: the group over at least this long before it began


def judge(r: Rollout, execs: list[Execution], devices: DeviceStore, rollouts: RolloutStore, now: float
          ) -> tuple[str, dict, str | None]:
    """The gates of wave ``r.wave``, which is done and has baked: (outcome: pass, fail or
    inconclusive; the numbers it used; the reason, None for a pass)."""
    spec = r.spec
    reached = [e for e in execs if e.wave <= r.wave]
    executed = [e for e in reached if e.state in DONE]
    failures = [e for e in executed if e.state in FAILURES]
    numbers: dict = {"executed": len(executed), "failed": len(failures),
                     "failure_rate": len(failures) / len(executed) if executed else None,
                     "max_failure_rate": spec.max_failure_rate, "min_executed": spec.min_executed,
                     "reasons": sorted({e.detail for e in failures if e.detail})[:5]}
    if len(executed) >= spec.min_executed:
        if numbers["failure_rate"] > spec.max_failure_rate:
            return "fail", numbers, (f"wave {r.wave + 1}: install failure rate {numbers['failure_rate']:.2f} "
                                     f"above {spec.max_failure_rate}")
    elif failures:
        return "inconclusive", numbers, (f"wave {r.wave + 1}: {len(failures)} of {len(executed)} executed failed, "
                                         f"fewer than --min-executed {spec.min_executed} to judge")
    gates = spec.parsed_gates
    if gates:
        updated = [e.device_id for e in execs if e.state == ExecutionState.SUCCEEDED]
        control = [e.device_id for e in execs if e.state == ExecutionState.QUEUED]
        start = r.wave_done_at
        up = window_metrics({d: devices.telemetry_window(d, start, now) for d in updated}, start, now)
        ctl, control_from = _control(r, control, updated, devices, rollouts, start, now)
        numbers.update(window=[start, now], updated=up, control=ctl, control_from=control_from,
                       min_requests=spec.min_requests, min_devices=spec.min_devices, gates=[])
        relative = any(g.kind != "absolute" for g in gates)
        if up["requests"] < spec.min_requests or (ctl is not None and relative and
                                                  ctl["requests"] < spec.min_requests):
            return "inconclusive", numbers, (f"wave {r.wave + 1}: too little traffic to judge ({up['requests']} "
                                             f"requests on updated devices, {'-' if ctl is None else ctl['requests']} "
                                             f"on the control group; --min-requests {spec.min_requests})")
        failed_gates, unknown = [], []
        for g in gates:
            value = up.get(g.metric) if up.get(f"{g.metric}_devices", 0) >= spec.min_devices else None
            base = None
            if g.kind != "absolute" and ctl is not None and ctl.get(f"{g.metric}_devices", 0) >= spec.min_devices:
                base = ctl.get(g.metric)
            ok, how = g.judge(value, base)
            numbers["gates"].append({"gate": g.text, "passed": ok, "how": how})
            if ok is False:
                failed_gates.append(how)
            elif ok is None:  # no value, too few devices with one, or nothing to compare with: never a pass
                unknown.append(g.metric)
        if failed_gates:
            return "fail", numbers, f"wave {r.wave + 1}: gate failed: {'; '.join(failed_gates)}"
        if unknown:
            return "inconclusive", numbers, (f"wave {r.wave + 1}: no value for {', '.join(unknown)} (from at least "
                                             f"--min-devices {spec.min_devices} device(s) a side; control: "
                                             f"{control_from})")
    return "pass", numbers, None


def _control(r: Rollout, control: list[str], updated: list[str], devices: DeviceStore, rollouts: RolloutStore,
             start: float, now: float) -> tuple[dict | None, str]:
    """What the updated devices are compared with, and where it comes from: the devices not yet
    updated over the same window; at the last wave (none left), the control group the wave before
    was judged against; in a rollout of one wave, the same devices before the rollout began."""
    if control:
        return window_metrics({d: devices.telemetry_window(d, start, now) for d in control}, start, now), \
            "the devices not yet updated, over the same window"
    for d in reversed(rollouts.decisions(r.rollout_id)):
        if isinstance(d.get("control"), dict) and d.get("control_from", "").startswith("the devices not yet"):
            return d["control"], f"wave {d['wave'] + 1}'s control group (the last measured on the old version)"
    length = max(now - start, BASELINE_MIN_S)
    before = window_metrics({d: devices.telemetry_window(d, r.created_at - length, r.created_at) for d in updated},
                            r.created_at - length, r.created_at)
    if before["devices"]:
        return before, f"the same devices over {length:.0f} s before the rollout began"
    return None, "none: no telemetry from before the rollout"
