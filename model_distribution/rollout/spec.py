"""Staged rollouts: what a rollout is, its waves and gates; its durable state in the registry's
database is ``store.py``, and the controller (``controller.py``) moves it.

A rollout takes a group to ``name@version`` in waves (cumulative percentages of the group, the
last 100). Devices are ordered by a hash of (rollout, device), so the waves are fixed when the
rollout starts and the same on every restart. Each device has an execution:

    QUEUED -> IN_PROGRESS (detail: the device's step) -> SUCCEEDED | FAILED | TIMED_OUT | REJECTED
    QUEUED -> CANCELED (abort, rollback);   any assigned -> ROLLED_BACK (rollback)

(states.py holds those states and the moves allowed between them.)

Every change of an execution or of the rollout is a compare-and-set on its ``version`` column,
so a late report (or a second controller) never overwrites a newer state.

A wave passes its gates once its devices are done and it has baked: the install failure rate
(FAILED + TIMED_OUT + REJECTED over executed, judged after ``min_executed``), then the serving
gates, which compare the devices already updated with the group's devices not yet updated over
the same window (the bake), each judged after ``min_requests`` on both sides. A side's value of a
metric is a statistic over its devices' own values (fleet/serving.py ``robust_mean``), judged once at least
``min_devices`` devices of each side have one, so no single device decides a gate. The last wave
has no devices left on the old version: it is compared with the control group of the wave judged
before it, or, in a rollout of one wave, with the same devices over the time before the rollout
began; with neither, a relative gate is inconclusive, never passed for want of data:

    escalation_rate<=+0.05   updated minus control at most 0.05 (a signed bound: a difference)
    ttft_p95<=1.2x           updated at most 1.2 times control (a ratio)
    error_rate<=0.01         updated at most 0.01 (a plain number: absolute)
    decode_tps>=0.9x         higher is better: >=
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import re
from dataclasses import asdict, dataclass, field

from model_distribution.protocol.windows import parse_window
from model_distribution.registry.store import RegistryError
from model_distribution.rollout.states import ExecutionState, RolloutState

METRICS = {"escalation_rate": "lower", "error_rate": "lower", "ttft_p95": "lower", "decode_tps": "higher"}

class RolloutError(RegistryError):
    """A rollout refused (bad input, a group with a rollout already, an unknown one)."""


class RolloutConflict(RolloutError):
    """Refused because of another rollout: its group's, or one that has some of the same devices."""


@dataclass(frozen=True)
class Gate:
    metric: str
    op: str  # "<=" or ">="
    kind: str  # "delta" (a signed bound), "ratio" (a bound with x), "absolute"
    bound: float
    text: str

    @classmethod
    def parse(cls, text: str) -> Gate:
        m = re.fullmatch(r"\s*([a-z_0-9]+)\s*(<=|>=)\s*([+-]?)(\d+(?:\.\d+)?)\s*(x?)\s*", text or "")
        if m is None:
            raise RolloutError(f"gate {text!r} is not METRIC<=BOUND or METRIC>=BOUND (e.g. escalation_rate<=+0.05, "
                               "ttft_p95<=1.2x, error_rate<=0.01)")
        metric, op, sign, number, ratio = m.groups()
        if metric not in METRICS:
            raise RolloutError(f"gate {text!r}: unknown metric {metric!r} (one of {', '.join(METRICS)})")
        if ratio and sign:
            raise RolloutError(f"gate {text!r}: a ratio takes no sign (e.g. 1.2x)")
        kind = "ratio" if ratio else "delta" if sign else "absolute"
        bound = float(number) * (-1 if sign == "-" else 1)
        return cls(metric, op, kind, bound, text.strip())

    def judge(self, updated: float | None, control: float | None) -> tuple[bool | None, str]:
        """(passed, how); passed None when there is nothing to compare (no value, no control)."""
        if updated is None:
            return None, f"{self.metric}: no value for the updated devices"
        if self.kind == "absolute":
            limit = self.bound
        elif control is None:
            return None, f"{self.metric}: no control group to compare with"
        else:
            limit = control + self.bound if self.kind == "delta" else control * self.bound
        ok = updated <= limit if self.op == "<=" else updated >= limit
        against = "" if control is None else f", control {control:.4g}"
        return ok, f"{self.metric} {updated:.4g}, limit {self.op} {limit:.4g} ({self.text}{against})"


def parse_waves(text: str) -> list[int]:
    try:
        waves = [int(w) for w in str(text).split(",")]
    except ValueError:
        raise RolloutError(f"waves {text!r} must be percentages like 1,10,50,100") from None
    if not waves or any(not 0 < w <= 100 for w in waves) or waves != sorted(set(waves)) or waves[-1] != 100:
        raise RolloutError(f"waves {text!r} must be increasing percentages of the group in 1..100, the last 100")
    return waves


def parse_duration(text: str | float) -> float:
    """"90", "90s", "2m", "1h" -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", str(text))
    if m is None:
        raise RolloutError(f"duration {text!r} must be a number of seconds or like 90s, 2m, 1h")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[m.group(2)]


@dataclass
class RolloutSpec:
    model: str  # name@version
    group: str
    waves: list[int] = field(default_factory=lambda: [1, 10, 50, 100])
    bake_s: float = 0.0
    gates: list[str] = field(default_factory=list)
    max_failure_rate: float = 0.0
    min_executed: int = 1
    min_requests: int = 0
    min_devices: int = 1  # a serving gate is judged once this many devices of each side have a value
    step_timeout_s: float = 600.0  # no word from a device for this long: TIMED_OUT
    window: str | None = None  # "HH:MM-HH:MM" or cron, device local time: activate only then (download whenever)
    jitter_s: float = 0.0  # each device waits a random 0..jitter_s before it downloads
    prefetch: bool = True  # devices of later waves download and verify while earlier waves bake

    def __post_init__(self):
        if self.window:
            try:
                parse_window(self.window)
            except ValueError as e:
                raise RolloutError(str(e)) from None
        self.jitter_s = parse_duration(self.jitter_s)
        self.waves = parse_waves(",".join(map(str, self.waves)) if isinstance(self.waves, list) else self.waves)
        self.bake_s = parse_duration(self.bake_s)
        self.step_timeout_s = parse_duration(self.step_timeout_s)
        for g in self.gates:
            Gate.parse(g)
        if not 0 <= self.max_failure_rate <= 1:
            raise RolloutError(f"max failure rate {self.max_failure_rate} must be in 0..1")
        if self.min_executed < 1 or self.min_requests < 0 or self.min_devices < 1:
            raise RolloutError("min executed must be >= 1, min requests >= 0 and min devices >= 1")
        if self.step_timeout_s <= 0:
            raise RolloutError("the step timeout must be > 0")

    @classmethod
    def from_stored(cls, fields: dict) -> RolloutSpec:
        """A spec as the store kept it (checked when the rollout was created): not checked again,
        so a check made stricter later never makes a stored rollout unreadable. Fields added
        since it was stored take their defaults."""
        spec = cls.__new__(cls)
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            spec.__dict__[f.name] = fields.get(f.name, default)
        return spec

    @property
    def parsed_gates(self) -> list[Gate]:
        return [Gate.parse(g) for g in self.gates]


@dataclass
class Rollout:
    rollout_id: str
    group: str
    model: str
    version: str
    spec: RolloutSpec
    state: RolloutState
    reason: str | None
    wave: int  # index into spec.waves of the wave being rolled out
    wave_done_at: float | None
    created_at: float
    updated_at: float
    row_version: int

    @property
    def ref(self) -> str:
        return f"{self.model}@{self.version}"

    def to_dict(self) -> dict:
        return {"rollout": self.rollout_id, "group": self.group, "model": self.ref, "state": self.state,
                "reason": self.reason, "wave": self.wave, "waves": self.spec.waves, "spec": asdict(self.spec),
                "wave_done_at": self.wave_done_at, "created_at": self.created_at, "updated_at": self.updated_at}


@dataclass
class Execution:
    rollout_id: str
    device_id: str
    wave: int
    state: ExecutionState
    detail: str | None
    previous: str | None  # name@version it had before: what a rollback sets again
    desired_rev: int | None
    heard_at: float | None  # when the controller last heard from it about this assignment (its clock)
    report_at: float | None  # the device's own time on that report (to tell a new report from the last)
    updated_at: float
    row_version: int
    wait_until: float | None = None  # WAITING for its window: its heartbeats count as word until then

    def to_dict(self) -> dict:
        return asdict(self)


def wave_plan(rollout_id: str, devices: list[str], waves: list[int]) -> dict[str, int]:
    """device -> index of its wave: devices in a fixed hashed order, wave k holding the first
    ceil(waves[k]% of them) (at least one)."""
    order = sorted(devices, key=lambda d: hashlib.sha256(f"{rollout_id}:{d}".encode()).digest())
    ends = [max(1, math.ceil(w * len(order) / 100)) for w in waves]
    plan = {}
    for i, device in enumerate(order):
        plan[device] = next(k for k, end in enumerate(ends) if i < end)
    return plan


def held_text(held: dict[str, str]) -> str:
    """"d1 in r-1, d2 in r-2, ..." for the first few of ``held`` (device -> the rollout holding it)."""
    names = sorted(held)
    return ", ".join(f"{d} in {held[d]}" for d in names[:5]) + (", ..." if len(names) > 5 else "")


def joiner_wave(rollout_id: str, device: str, waves: list[int]) -> int:
    """The wave of a device that joined the group mid-rollout: by where its hash falls."""
    h = int.from_bytes(hashlib.sha256(f"{rollout_id}:{device}".encode()).digest()[:8], "big") / 2**64 * 100
    return next(k for k, w in enumerate(waves) if h < w)
