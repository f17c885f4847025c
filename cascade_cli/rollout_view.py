"""How ``cascade fleet rollout status`` reads: a rollout's waves as bars, its executions' states,
each wave's decision with its numbers, and the devices under way; from the status dict, the same
whether it came from the local store or a control plane elsewhere."""

from __future__ import annotations

from cascade_cli.tables import utc_time

EXECUTION_STATES = ("QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "TIMED_OUT", "REJECTED", "CANCELED",
                    "ROLLED_BACK")
_DONE = ("SUCCEEDED", "FAILED", "TIMED_OUT", "REJECTED")
_BAR = 20
_SHOWN_IN_PROGRESS = 10

def render_status(s: dict) -> str:
    """The status dict as text: the rollout, its waves, the executions' states, the decisions and
    the devices under way. Nothing here depends on the clock, so two calls on one state print the same."""
    reason = f" ({s['reason']})" if s.get("reason") else ""
    lines = [f"rollout {s['rollout']}  {s['model']}  group {s['group']}  {s['state']}{reason}"]
    execs = s["executions"]
    for k, pct in enumerate(s["waves"]):
        members = [e for e in execs if e["wave"] == k]
        done = sum(1 for e in members if e["state"] in _DONE)
        filled = round(_BAR * done / len(members)) if members else 0
        now = ""
        if k == s["wave"] and s["state"] == "PAUSED":
            now = "  <- paused"
        elif k == s["wave"] and s["state"] == "RUNNING":
            now = "  <- baking" if s.get("wave_done_at") is not None else "  <- rolling out"
        lines.append(f"wave {k + 1:<2} {pct:>3}%  [{'#' * filled}{'.' * (_BAR - filled)}]  "
                     f"{done}/{len(members)} done{now}")
    counts = {state: 0 for state in EXECUTION_STATES}
    for e in execs:
        counts[e["state"]] = counts.get(e["state"], 0) + 1
    lines.append("  ".join(f"{state} {n}" for state, n in counts.items()))
    if s["decisions"]:
        lines.append("decisions:")
        for d in s["decisions"]:
            lines += _decision_lines(d)
    busy = [e for e in execs if e["state"] == "IN_PROGRESS"]
    if busy:
        lines.append(f"in progress ({len(busy)}):")
        lines += [f"  {e['device_id']}  wave {e['wave'] + 1}  {e['detail'] or '-'}" for e in busy[:_SHOWN_IN_PROGRESS]]
        if len(busy) > _SHOWN_IN_PROGRESS:
            lines.append(f"  ... and {len(busy) - _SHOWN_IN_PROGRESS} more")
    return "\n".join(lines)


def _decision_lines(d: dict) -> list[str]:
    from model_distribution.rollout.spec import Gate

    at = utc_time(d["at"], "%H:%M:%SZ")
    head = f"  wave {d['wave'] + 1} {d['outcome']} at {at}"
    if d.get("by") == "operator":
        return [f"{head}: by the operator, after {d.get('after')}"]
    lines = [f"{head}: executed {d.get('executed')}, failed {d.get('failed')}, failure rate "
             f"{_num(d.get('failure_rate'))} (max {_num(d.get('max_failure_rate'))}, judged after "
             f"{d.get('min_executed')} executed)"]
    if d.get("reasons"):
        lines.append(f"    reasons: {'; '.join(d['reasons'])}")
    updated, control = d.get("updated"), d.get("control")
    if updated is not None:
        source = d.get("control_from", "the devices not yet updated")
        lines.append(f"    requests: updated {updated.get('requests')} on {updated.get('devices', '-')} device(s), "
                     f"control {'-' if control is None else control.get('requests')} on "
                     f"{'-' if control is None else control.get('devices', '-')} (min {d.get('min_requests')} "
                     f"requests, {d.get('min_devices', 1)} device(s)); control: {source}")
    for g in d.get("gates") or []:
        metric = Gate.parse(g["gate"]).metric
        verdict = {True: "pass", False: "FAIL", None: "no data: not passed"}[g["passed"]]
        lines.append(f"    {g['gate']}: updated {_num((updated or {}).get(metric))} vs control "
                     f"{_num((control or {}).get(metric))}: {verdict}")
    return lines


def _num(value) -> str:
    return "-" if value is None else f"{value:.4g}"

