"""How devices serve, from their telemetry: one device's numbers over a window, and a group's as
a statistic over its devices.

Telemetry counters are cumulative since the agent started, so a device's numbers over a window
are its counters at the end less those at the start (a restart inside the window starts from
zero), bounded by what it could have done in the time between (``MAX_DEVICE_RATE``). A group's
value of a metric is a statistic over its devices (``robust_mean``): each device's value weighted
by its requests, but no device weighing more than the group's median device (one claiming a
flood counts as one typical device), and once a group has four devices or more, the one with the
highest value and the one with the lowest left out (one device's extreme cannot move it at all).
The request totals, which only decide whether there is enough traffic to judge, are sums of the
bounded counts.
"""

from __future__ import annotations

import math
import statistics

from model_distribution.protocol.device_messages import CLOCK_SKEW_S, MAX_DEVICE_RATE

METRICS = ("escalation_rate", "error_rate", "ttft_p95", "decode_tps")
MAX_DECODE_TPS = 1e6  # tokens a second: past any device
NOT_ANSWERS = ("models", "requests", "other")  # the agent's endpoints that answer no prompt (listings, polls)


def is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def counter_deltas(new: dict, base: dict | None, within_s: float | None = None) -> dict:
    """What a device's telemetry counters say happened between record ``base`` (None: since its
    agent started) and record ``new``: decisions (and how many the cloud took), requests answered
    (and how many 5xx), TTFT histogram buckets, decode tokens and seconds. Only numbers count, no
    counter goes backwards, and none says more than the device could have done in the time (with
    no ``base``: since its agent started, and within ``within_s`` when that is given)."""
    decisions, requests = _delta(new, base, "decisions"), _delta(new, base, "requests")
    requests = {k: v for k, v in requests.items() if k.rsplit("/", 1)[0] not in NOT_ANSWERS}
    ttft = _delta((new.get("latency") or {}).get("ttft") or {}, ((base or {}).get("latency") or {}).get("ttft"),
                  "buckets")
    decode = _delta(new, base, "decode")
    most = _most(new, base, within_s)
    decided = min(sum(decisions.values()), most)
    answered = min(sum(requests.values()), most)
    return {"decided": decided,
            "cloud": min(decided, sum(v for k, v in decisions.items() if k.startswith("cloud/"))),
            "answered": answered,
            "failed": min(answered, sum(v for k, v in requests.items() if k.rsplit("/", 1)[-1].startswith("5"))),
            "ttft_buckets": {k: min(v, most) for k, v in ttft.items()},
            "decode_tokens": min(decode.get("tokens", 0), 100 * most), "decode_s": decode.get("seconds", 0)}


def _most(new: dict, base: dict | None, within_s: float | None) -> float:
    """The most requests a device could have answered between the two records."""
    if base is not None and is_number(new.get("ts")) and is_number(base.get("ts")):
        elapsed = max(0.0, new["ts"] - base["ts"])
    else:
        elapsed = max(0.0, new["uptime_s"]) if is_number(new.get("uptime_s")) else math.inf
        if within_s is not None:
            elapsed = min(elapsed, within_s)
    return (elapsed + CLOCK_SKEW_S) * MAX_DEVICE_RATE


def _delta(new: dict, base: dict | None, key: str) -> dict[str, float]:
    now = new.get(key) if isinstance(new, dict) and isinstance(new.get(key), dict) else {}
    then = base.get(key) if isinstance(base, dict) and isinstance(base.get(key), dict) else {}
    return {k: max(0.0, v - (then.get(k) if is_number(then.get(k)) else 0)) for k, v in now.items() if is_number(v)}


def serving_summary(new: dict | None, base: dict | None = None) -> dict:
    """Requests, escalation rate, error rate and backlog from a device's newest telemetry record,
    less ``base``: an older record of the same agent run, so the rates cover the time between."""
    if not new:
        return {}
    c = counter_deltas(new, base)
    queue = new.get("queue") if isinstance(new.get("queue"), dict) else {}
    backlog = queue.get("pending")
    return {"requests": int(c["answered"]),
            "escalation_rate": round(c["cloud"] / c["decided"], 4) if c["decided"] else None,
            "error_rate": round(c["failed"] / c["answered"], 4) if c["answered"] else None,
            "backlog": int(backlog) if is_number(backlog) else None,
            "at": new.get("ts") if is_number(new.get("ts")) else None}


def device_window(records: list[dict], start: float, end: float) -> dict | None:
    """One device's numbers between ``start`` and ``end`` from its records (oldest first): None
    when it sent none inside the window."""
    inside = [r for r in records if is_number(r.get("ts")) and start <= r["ts"] <= end]
    if not inside:
        return None
    new = inside[-1]
    before = [r for r in records if is_number(r.get("ts")) and r["ts"] < start]
    base = before[-1] if before else None
    if base is not None and is_number(new.get("uptime_s")) and is_number(base.get("uptime_s")) and \
            base["uptime_s"] > new["uptime_s"]:
        base = None  # the agent restarted: its counters did too
    c = counter_deltas(new, base, end - start)  # with no record before the window: no more than the window
    decided, answered = c["decided"], c["answered"]
    decode_s = c["decode_s"]
    return {"requests": answered, "decided": decided,
            "escalation_rate": c["cloud"] / decided if decided else None,
            "error_rate": c["failed"] / answered if answered else None,
            "ttft_p95": _quantile(c["ttft_buckets"], 0.95),
            # tokens over less than a millisecond of decoding is no speed (5e-324 s made it infinite)
            "decode_tps": min(c["decode_tokens"] / decode_s, MAX_DECODE_TPS) if decode_s >= 1e-3 else None}


def window_metrics(records_by_device: dict[str, list[dict]], start: float, end: float) -> dict:
    """A set of devices' numbers between ``start`` and ``end``: ``requests`` (the sum), ``devices``
    (how many sent telemetry inside the window) and each metric as ``robust_mean`` over the
    devices that have a value for it (None when none has), with how many those are."""
    per = [m for m in (device_window(records, start, end) for records in records_by_device.values()) if m]
    out: dict = {"requests": int(sum(m["requests"] for m in per)), "devices": len(per)}
    for metric in METRICS:
        weight = "decided" if metric == "escalation_rate" else "requests"
        values = [(m[metric], m[weight]) for m in per if m[metric] is not None]
        out[metric] = robust_mean(values)
        out[f"{metric}_devices"] = len(values)
    return out


def robust_mean(values: list[tuple[float, float]]) -> float | None:
    """The mean of (value, weight) per device, each weight capped at the median weight, leaving out
    the highest and the lowest value once there are four or more (see the module docstring)."""
    if not values:
        return None
    cap = statistics.median(w for _, w in values)
    points = sorted((v, min(w, cap)) for v, w in values)
    if len(points) >= 4:
        points = points[1:-1]
    total = sum(w for _, w in points)
    if total <= 0:
        return statistics.median(v for v, _ in points)
    return sum(v * w for v, w in points) / total


def _quantile(buckets: dict[str, float], q: float) -> float | None:
    """From cumulative histogram buckets {upper bound: count} (Prometheus style, "+Inf" last)."""
    bounds = []
    for b, n in buckets.items():
        try:
            bounds.append((float(b), n))
        except ValueError:  # a record kept before records were checked
            continue
    bounds.sort()
    if not bounds or bounds[-1][1] <= 0:
        return None
    want = q * bounds[-1][1]
    for bound, n in bounds:
        if n >= want:
            return bound if math.isfinite(bound) else bounds[-2][0] if len(bounds) > 1 else None
    return None
