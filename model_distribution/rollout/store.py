"""A rollout's durable state in the registry's database (portable SQL): rollouts, each device's
execution and each judgement with its numbers. Every change of an execution or of a rollout is a
compare-and-set on its ``row_version`` column, so a late report (or a second controller) never
overwrites a newer state; a device is held by at most one rollout under way (``create``,
``add_execution`` check it in the same transaction as they write)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

from cascade import wire
from model_distribution.rollout.spec import (
    Execution,
    Rollout,
    RolloutConflict,
    RolloutError,
    RolloutSpec,
    held_text,
)
from model_distribution.rollout.states import (
    ACTIVE_STATES,
    RELEASED,
    ExecutionState,
    RolloutState,
    check_execution_move,
    check_rollout_move,
)
from sync.sqlite import connect, transaction

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


_R_COLUMNS = ("rollout_id, group_name, model, version, spec, state, reason, wave, wave_done_at, created_at, "
              "updated_at, row_version")
_E_COLUMNS = ("rollout_id, device_id, wave, state, detail, previous, desired_rev, heard_at, report_at, updated_at, "
              "row_version, wait_until")


class RolloutStore:
    def __init__(self, root: Path | str, clock: Callable[[], float] = time.time):
        self.clock = clock  # the control plane's clock (tests fake it)
        Path(root).mkdir(parents=True, exist_ok=True)
        self._db = connect(Path(root) / "registry.db", timeout_s=30.0)
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
        with self._lock, transaction(self._db):
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
                             (rid, spec.group, name, version, json.dumps(asdict(spec)), RolloutState.RUNNING, now,
                              now))
            self._db.executemany(
                f"INSERT INTO rollout_devices ({_E_COLUMNS}) VALUES (?, ?, ?, ?, NULL, ?, NULL, NULL, NULL, ?, 0, "
                "NULL)",
                [(rid, d, wave, ExecutionState.QUEUED, prev, now) for d, (wave, prev) in executions.items()])
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
        the stored version; the new rollout, or None when someone changed it first. IllegalMove
        (nothing written) for a state ``r.state`` may not move to."""
        allowed = {"state", "reason", "wave", "wave_done_at"}
        if not set(changes) <= allowed:
            raise ValueError(f"cannot change {set(changes) - allowed}")
        if "state" in changes:
            changes["state"] = check_rollout_move(r.state, changes["state"])
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
        return [_execution(r) for r in rows]

    def execution(self, rollout_id: str, device_id: str) -> Execution:
        with self._lock:
            row = self._db.execute(f"SELECT {_E_COLUMNS} FROM rollout_devices WHERE rollout_id = ? AND device_id = ?",
                                   (rollout_id, device_id)).fetchone()
        return _execution(row)

    def add_execution(self, rollout_id: str, device_id: str, wave: int, previous: str | None) -> bool:
        """A device that joined the group mid-rollout; False (nothing added) while another rollout
        under way holds it."""
        with self._lock, transaction(self._db):
            if self._held_by_others([device_id], rollout_id):
                return False  # nothing written: the transaction commits nothing
            self._db.execute(f"INSERT OR IGNORE INTO rollout_devices ({_E_COLUMNS}) "
                             "VALUES (?, ?, ?, ?, NULL, ?, NULL, NULL, NULL, ?, 0, NULL)",
                             (rollout_id, device_id, wave, ExecutionState.QUEUED, previous, self.clock()))
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
                (*ACTIVE_STATES, *RELEASED, rollout_id or "", *chunk)).fetchall()
            held.update(dict(rows))
        return held

    def move(self, e: Execution, state: str, detail: str | None = None, at: float | None = None,
             desired_rev: int | None = None, report_at: float | None = None, wait_until: float | None = None) -> bool:
        """Compare-and-set an execution's state at ``at`` (the controller's clock; heard from the
        device then when ``report_at`` is given); False when it changed since ``e`` was read.
        IllegalMove (nothing written) for a state ``e.state`` may not move to."""
        state = check_execution_move(e.state, state)
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
        not 500); the ones that moved, as they are now (the others changed since they were read).
        IllegalMove (nothing written) if any of them may not move to ``state``."""
        for e in execs:
            state = check_execution_move(e.state, state)
        moved = []
        with self._lock, transaction(self._db, immediate=False):
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
                             "VALUES (?, ?, ?, ?, ?)", (rollout_id, self.clock(), wave, outcome,
                                                        json.dumps(wire.finite(numbers), allow_nan=False)))

    def decisions(self, rollout_id: str) -> list[dict]:
        with self._lock:
            rows = self._db.execute("SELECT at, wave, outcome, numbers FROM rollout_decisions WHERE rollout_id = ? "
                                    "ORDER BY at", (rollout_id,)).fetchall()
        # finite(): decisions kept before their numbers were checked may hold an infinity
        return [{"at": at, "wave": wave, "outcome": outcome, **wire.finite(json.loads(numbers))}
                for at, wave, outcome, numbers in rows]


def _rollout(row) -> Rollout:
    rid, group, model, version, spec, state, reason, wave, done_at, created, updated, rv = row
    return Rollout(rid, group, model, version, RolloutSpec.from_stored(json.loads(spec)), RolloutState(state), reason,
                   wave, done_at, created, updated, rv)


def _execution(row) -> Execution:
    rollout_id, device_id, wave, state, *rest = row
    return Execution(rollout_id, device_id, wave, ExecutionState(state), *rest)
