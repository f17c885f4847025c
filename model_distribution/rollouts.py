"""Staged rollouts: what a rollout is, its waves and gates, and its durable state in the
registry's database (portable SQL). The controller (``rollout_controller.py``) moves it.

A rollout takes a group to ``name@version`` in waves (cumulative percentages of the group, the
last 100). Devices are ordered by a hash of (rollout, device), so the waves are fixed when the
rollout starts and the same on every restart. Each device has an execution:

    QUEUED -> IN_PROGRESS (detail: the device's step) -> SUCCEEDED | FAILED | TIMED_OUT | REJECTED
    QUEUED -> CANCELED (abort, rollback);   any assigned -> ROLLED_BACK (rollback)

Every change of an execution or of the rollout is a compare-and-set on its ``version`` column,
so a late report (or a second controller) never overwrites a newer state.

A wave passes its gates once its devices are done and it has baked: the install failure rate
(FAILED + TIMED_OUT + REJECTED over executed, judged after ``min_executed``), then the serving
gates, which compare the devices already updated with the group's devices not yet updated over
the same window (the bake), each judged after ``min_requests`` on both sides. A side's value of a
metric is the median of its devices' own values (serving.py), judged once at least
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
import json
import math
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from model_distribution.registry import RegistryError

QUEUED, IN_PROGRESS, SUCCEEDED, FAILED, TIMED_OUT, REJECTED, CANCELED, ROLLED_BACK = (
    "QUEUED", "IN_PROGRESS", "SUCCEEDED", "FAILED", "TIMED_OUT", "REJECTED", "CANCELED", "ROLLED_BACK")
DONE = (SUCCEEDED, FAILED, TIMED_OUT, REJECTED)  # executed: counted by the failure gate
FAILURES = (FAILED, TIMED_OUT, REJECTED)
RUNNING, PAUSED, COMPLETED, HALTED, ABORTED = "RUNNING", "PAUSED", "SUCCEEDED", "ROLLED_BACK", "ABORTED"
ACTIVE_STATES = (RUNNING, PAUSED)  # one such rollout per group
METRICS = {"escalation_rate": "lower", "error_rate": "lower", "ttft_p95": "lower", "decode_tps": "higher"}

SCHEMA = (
    """CREATE TABLE IF NOT EXISTS rollouts (
        rollout_id VARCHAR(32) PRIMARY KEY,
        group_name VARCHAR(64) NOT NULL,
        model VARCHAR(64) NOT NULL,
        version VARCHAR(64) NOT NULL,
        spec TEXT NOT NULL,
        state VARCHAR(16) NOT NULL,
        reason TEXT,
        wave INTEGER NOT NULL DEFAULT 0,
        wave_done_at DOUBLE PRECISION,
        created_at DOUBLE PRECISION NOT NULL,
        updated_at DOUBLE PRECISION NOT NULL,
        row_version INTEGER NOT NULL DEFAULT 0
    )""",
    """CREATE TABLE IF NOT EXISTS rollout_devices (
        rollout_id VARCHAR(32) NOT NULL,
        device_id VARCHAR(64) NOT NULL,
        wave INTEGER NOT NULL,
        state VARCHAR(16) NOT NULL,
        detail TEXT,
        previous VARCHAR(130),
        desired_rev INTEGER,
        heard_at DOUBLE PRECISION,
        report_at DOUBLE PRECISION,
        updated_at DOUBLE PRECISION NOT NULL,
        row_version INTEGER NOT NULL DEFAULT 0,
        wait_until DOUBLE PRECISION,
        PRIMARY KEY (rollout_id, device_id)
    )""",
    """CREATE TABLE IF NOT EXISTS rollout_decisions (
        rollout_id VARCHAR(32) NOT NULL,
        at DOUBLE PRECISION NOT NULL,
        wave INTEGER NOT NULL,
        outcome VARCHAR(16) NOT NULL,
        numbers TEXT NOT NULL
    )""",
    "CREATE INDEX IF NOT EXISTS rollout_decisions_by_rollout ON rollout_decisions (rollout_id, at)",
)


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
        from model_distribution.device_client import _window

        if self.window:
            try:
                _window(self.window)
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
    state: str
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
    state: str
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


_R_COLUMNS = ("rollout_id, group_name, model, version, spec, state, reason, wave, wave_done_at, created_at, "
              "updated_at, row_version")
_E_COLUMNS = ("rollout_id, device_id, wave, state, detail, previous, desired_rev, heard_at, report_at, updated_at, "
              "row_version, wait_until")
BUSY = ("CANCELED", "ROLLED_BACK")  # an execution in an active rollout in neither of these holds its device


class RolloutStore:
    def __init__(self, root: Path | str, clock: Callable[[], float] = time.time):
        self.clock = clock  # the control plane's clock (tests fake it)
        Path(root).mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(Path(root) / "registry.db", isolation_level=None, check_same_thread=False,
                                   timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        for ddl in SCHEMA:
            self._db.execute(ddl)
        if "wait_until" not in {r[1] for r in self._db.execute("PRAGMA table_info(rollout_devices)")}:
            self._db.execute("ALTER TABLE rollout_devices ADD COLUMN wait_until DOUBLE PRECISION")
        self._lock = threading.RLock()

    def close(self) -> None:
        self._db.close()

    # -- rollouts ---------------------------------------------------------------------------

    def create(self, spec: RolloutSpec, executions: dict[str, tuple[int, str | None]]) -> Rollout:
        """A new RUNNING rollout of ``spec`` with ``executions``: device -> (wave, previous).
        RolloutError if its group has a running or paused rollout."""
        name, _, version = spec.model.partition("@")
        now = self.clock()
        rid = f"r-{int(now)}-{secrets.token_hex(3)}"
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                busy = self._db.execute("SELECT rollout_id, model, version FROM rollouts WHERE group_name = ? AND "
                                        "state IN (?, ?)", (spec.group, *ACTIVE_STATES)).fetchone()
                if busy is not None:
                    raise RolloutConflict(f"group {spec.group!r} has rollout {busy[0]} of {busy[1]}@{busy[2]} under "
                                          "way (pause, abort or roll it back first)")
                held = self._held_by_others(list(executions), None)
                if held:  # one device, one rollout at a time: two would each think it ran theirs
                    raise RolloutConflict(f"{len(held)} device(s) of {spec.group!r} are in another rollout under way "
                                          f"({held_text(held)}): let it finish, or abort it first")
                self._db.execute(f"INSERT INTO rollouts ({_R_COLUMNS}) "
                                 "VALUES (?, ?, ?, ?, ?, ?, NULL, 0, NULL, ?, ?, 0)",
                                 (rid, spec.group, name, version, json.dumps(asdict(spec)), RUNNING, now, now))
                self._db.executemany(
                    f"INSERT INTO rollout_devices ({_E_COLUMNS}) VALUES (?, ?, ?, ?, NULL, ?, NULL, NULL, NULL, ?, 0, "
                    "NULL)",
                    [(rid, d, wave, QUEUED, prev, now) for d, (wave, prev) in executions.items()])
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return self.get(rid)

    def get(self, rollout_id: str) -> Rollout:
        with self._lock:
            row = self._db.execute(f"SELECT {_R_COLUMNS} FROM rollouts WHERE rollout_id = ?", (rollout_id,)).fetchone()
        if row is None:
            raise RolloutError(f"no rollout {rollout_id!r} (see cascade fleet rollout list)")
        return _rollout(row)

    def list(self, states: tuple[str, ...] | None = None) -> list[Rollout]:
        sql, args = f"SELECT {_R_COLUMNS} FROM rollouts", ()
        if states:
            sql += f" WHERE state IN ({', '.join('?' * len(states))})"
            args = states
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY created_at DESC", args).fetchall()
        return [_rollout(r) for r in rows]

    def update(self, r: Rollout, **changes) -> Rollout | None:
        """Compare-and-set: apply ``changes`` (state, reason, wave, wave_done_at) if ``r`` is still
        the stored version; the new rollout, or None when someone changed it first."""
        allowed = {"state", "reason", "wave", "wave_done_at"}
        if not set(changes) <= allowed:
            raise ValueError(f"cannot change {set(changes) - allowed}")
        sets = ", ".join(f"{k} = ?" for k in changes)
        with self._lock:
            cur = self._db.execute(f"UPDATE rollouts SET {sets}, updated_at = ?, row_version = row_version + 1 "
                                   "WHERE rollout_id = ? AND row_version = ?",
                                   (*changes.values(), self.clock(), r.rollout_id, r.row_version))
        return self.get(r.rollout_id) if cur.rowcount == 1 else None

    # -- executions -------------------------------------------------------------------------

    def executions(self, rollout_id: str) -> list[Execution]:
        with self._lock:
            rows = self._db.execute(f"SELECT {_E_COLUMNS} FROM rollout_devices WHERE rollout_id = ? "
                                    "ORDER BY wave, device_id", (rollout_id,)).fetchall()
        return [Execution(*r) for r in rows]

    def execution(self, rollout_id: str, device_id: str) -> Execution:
        with self._lock:
            row = self._db.execute(f"SELECT {_E_COLUMNS} FROM rollout_devices WHERE rollout_id = ? AND device_id = ?",
                                   (rollout_id, device_id)).fetchone()
        return Execution(*row)

    def add_execution(self, rollout_id: str, device_id: str, wave: int, previous: str | None) -> bool:
        """A device that joined the group mid-rollout; False (nothing added) while another rollout
        under way holds it."""
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                if self._held_by_others([device_id], rollout_id):
                    self._db.execute("ROLLBACK")
                    return False
                self._db.execute(f"INSERT OR IGNORE INTO rollout_devices ({_E_COLUMNS}) "
                                 "VALUES (?, ?, ?, ?, NULL, ?, NULL, NULL, NULL, ?, 0, NULL)",
                                 (rollout_id, device_id, wave, QUEUED, previous, self.clock()))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return True

    def held_by_others(self, device_ids: list[str], rollout_id: str | None) -> dict[str, str]:
        """device -> the other rollout under way that holds it, for those of ``device_ids`` held."""
        with self._lock:
            return self._held_by_others(device_ids, rollout_id)

    def _held_by_others(self, device_ids: list[str], rollout_id: str | None) -> dict[str, str]:
        held: dict[str, str] = {}
        for i in range(0, len(device_ids), 500):
            chunk = device_ids[i:i + 500]
            rows = self._db.execute(
                "SELECT e.device_id, e.rollout_id FROM rollout_devices e "
                "JOIN rollouts r ON r.rollout_id = e.rollout_id "
                "WHERE r.state IN (?, ?) AND e.state NOT IN (?, ?) AND e.rollout_id <> ? "
                f"AND e.device_id IN ({', '.join('?' * len(chunk))})",
                (*ACTIVE_STATES, *BUSY, rollout_id or "", *chunk)).fetchall()
            held.update(dict(rows))
        return held

    def move(self, e: Execution, state: str, detail: str | None = None, at: float | None = None,
             desired_rev: int | None = None, report_at: float | None = None, wait_until: float | None = None) -> bool:
        """Compare-and-set an execution's state at ``at`` (the controller's clock; heard from the
        device then when ``report_at`` is given); False when it changed since ``e`` was read."""
        at = self.clock() if at is None else at
        with self._lock:
            cur = self._db.execute(
                "UPDATE rollout_devices SET state = ?, detail = ?, desired_rev = COALESCE(?, desired_rev), "
                "report_at = COALESCE(?, report_at), heard_at = CASE WHEN ? IS NULL THEN heard_at ELSE ? END, "
                "wait_until = COALESCE(?, wait_until), updated_at = ?, row_version = row_version + 1 "
                "WHERE rollout_id = ? AND device_id = ? AND row_version = ?",
                (state, detail, desired_rev, report_at, report_at, at, wait_until, at, e.rollout_id, e.device_id,
                 e.row_version))
        return cur.rowcount == 1

    def move_all(self, execs: list[Execution], state: str, detail: str | None, at: float,
                 desired_revs: dict[str, int] | None = None) -> list[Execution]:
        """``move`` for many executions in one transaction (a wave's 500 devices are one commit,
        not 500); the ones that moved, as they are now (the others changed since they were read)."""
        moved = []
        with self._lock:
            self._db.execute("BEGIN")
            try:
                for e in execs:
                    rev = (desired_revs or {}).get(e.device_id)
                    cur = self._db.execute(
                        "UPDATE rollout_devices SET state = ?, detail = ?, desired_rev = COALESCE(?, desired_rev), "
                        "updated_at = ?, row_version = row_version + 1 "
                        "WHERE rollout_id = ? AND device_id = ? AND row_version = ?",
                        (state, detail, rev, at, e.rollout_id, e.device_id, e.row_version))
                    if cur.rowcount == 1:
                        moved.append(replace(e, state=state, detail=detail, updated_at=at,
                                             row_version=e.row_version + 1,
                                             desired_rev=rev if rev is not None else e.desired_rev))
                self._db.execute("COMMIT")
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
        return moved

    def device_states(self) -> dict[str, tuple[str, str, str]]:
        """device -> (rollout, model@version, execution state) of its latest rollout."""
        with self._lock:
            rows = self._db.execute("SELECT e.device_id, e.rollout_id, r.model || '@' || r.version, e.state "
                                    "FROM rollout_devices e JOIN rollouts r ON r.rollout_id = e.rollout_id "
                                    "ORDER BY r.created_at").fetchall()
        return {d: (rid, ref, state) for d, rid, ref, state in rows}

    # -- decisions --------------------------------------------------------------------------

    def decide(self, rollout_id: str, wave: int, outcome: str, numbers: dict) -> None:
        with self._lock:
            self._db.execute("INSERT INTO rollout_decisions (rollout_id, at, wave, outcome, numbers) "
                             "VALUES (?, ?, ?, ?, ?)", (rollout_id, self.clock(), wave, outcome, json.dumps(numbers)))

    def decisions(self, rollout_id: str) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT at, wave, outcome, numbers FROM rollout_decisions WHERE rollout_id = ? "
                                    "ORDER BY at", (rollout_id,)).fetchall()
        return [{"at": at, "wave": wave, "outcome": outcome, **json.loads(numbers)} for at, wave, outcome, numbers
                in rows]


def _rollout(row) -> Rollout:
    rid, group, model, version, spec, state, reason, wave, done_at, created, updated, rv = row
    return Rollout(rid, group, model, version, RolloutSpec.from_stored(json.loads(spec)), state, reason, wave, done_at,
                   created, updated, rv)
