"""The fleet's devices, their groups, their desired state and what they say, in the registry's
database (portable SQL).

Enrolment makes a device's credentials (shown once; only a salted hash is kept); names the
system uses itself (``cascade-...``, the control plane's broker user among them) cannot be
enrolled. Setting the desired state (``cascade fleet assign``, and the rollout controller) bumps
the device's desired revision, which the signed document carries (desired.py).

What a device says (its reported state, telemetry, events, status) is outside data: it arrives
here typed and bounded (protocol/device_messages.py) or is refused; what was stored before that check is
read back leniently, so no row can break an operator's view.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from cascade import wire
from model_distribution.fleet.device_secrets import _hash_secret, check_secret, mosquitto_hash
from model_distribution.fleet.serving import is_number, serving_summary
from model_distribution.protocol import device_messages as messages
from model_distribution.protocol.device_messages import CLOCK_SKEW_S, Event, ReportedState, TelemetryRecord
from model_distribution.registry.store import Manifest, RegistryError
from sync.sqlite import connect, transaction

DEVICE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
RESERVED_PREFIX = "cascade-"  # the control plane's broker user and the system's own client ids
SCHEMA = (
    """CREATE TABLE IF NOT EXISTS devices (
        device_id VARCHAR(64) PRIMARY KEY,
        fleet VARCHAR(64) NOT NULL,
        secret_hash VARCHAR(200) NOT NULL,
        created_at DOUBLE PRECISION NOT NULL,
        desired_name VARCHAR(64),
        desired_version VARCHAR(64),
        desired_rev INTEGER NOT NULL DEFAULT 0,
        reported TEXT,
        last_seen DOUBLE PRECISION
    )""",
    """CREATE TABLE IF NOT EXISTS device_groups (
        device_id VARCHAR(64) NOT NULL,
        group_name VARCHAR(64) NOT NULL,
        PRIMARY KEY (device_id, group_name)
    )""",
    # Telemetry records as devices send them (cumulative counters since the agent started), one
    # row per record id: a record delivered twice (QoS 1 after a lost PUBACK) is stored once.
    """CREATE TABLE IF NOT EXISTS telemetry (
        device_id VARCHAR(64) NOT NULL,
        record_id VARCHAR(64) NOT NULL,
        ts DOUBLE PRECISION NOT NULL,
        received_at DOUBLE PRECISION NOT NULL,
        payload TEXT NOT NULL,
        PRIMARY KEY (device_id, record_id)
    )""",
    "CREATE INDEX IF NOT EXISTS telemetry_by_time ON telemetry (device_id, ts)",
    "CREATE INDEX IF NOT EXISTS telemetry_by_arrival ON telemetry (device_id, received_at)",
)
TELEMETRY_KEEP_S = 7 * 86400.0
MAX_RECORDS_PER_DEVICE = 2 * 7 * 2880  # a week of records every 30 s, twice over: past it a device's oldest go
RATE_WINDOW_S = 3600.0  # escalation and error rates are over the last hour of telemetry


@dataclass
class Device:
    device_id: str
    fleet: str
    groups: list[str] = field(default_factory=list)
    desired: str | None = None  # name@version
    desired_rev: int = 0
    reported: dict | None = None
    last_seen: float | None = None
    created_at: float = 0.0
    online: bool | None = None  # its retained status (None: never said)
    serving: dict = field(default_factory=dict)  # from its telemetry: requests, escalation/error rate, backlog
    last_event: dict | None = None  # the latest it said on its events topic
    prefetch: str | None = None  # name@version to download and verify now, to activate later (a rollout's later wave)
    window: str | None = None  # "HH:MM-HH:MM" or cron, its local time: it activates the desired version only then
    jitter_s: float = 0.0  # it waits a random 0..jitter_s before downloading (a wave does not arrive at one instant)

    def to_dict(self) -> dict:
        return {"device": self.device_id, "fleet": self.fleet, "groups": self.groups, "desired": self.desired,
                "desired_rev": self.desired_rev, "reported": self.reported, "online": self.online,
                "last_seen": self.last_seen, "created_at": self.created_at,
                "requests": self.serving.get("requests"), "escalation_rate": self.serving.get("escalation_rate"),
                "error_rate": self.serving.get("error_rate"), "backlog": self.serving.get("backlog"),
                "telemetry_at": self.serving.get("at"), "last_event": self.last_event, "prefetch": self.prefetch,
                "window": self.window}


def _locked(method):
    def run(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    run.__name__, run.__doc__ = method.__name__, method.__doc__
    return run


class DeviceStore:
    def __init__(self, root: Path | str, clock: Callable[[], float] = time.time):
        """``clock``: this control plane's clock (what a device's times are bounded by; tests fake it)."""
        self.clock = clock
        Path(root).mkdir(parents=True, exist_ok=True)
        self._db = connect(Path(root) / "registry.db", timeout_s=5.0)
        for ddl in SCHEMA:
            self._db.execute(ddl)
        self._lock = threading.RLock()  # one connection, used by the CLI, the server and paho's thread
        self._inserts: dict[str, int] = {}  # telemetry records kept per device since this store opened
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(devices)")}
        if "broker_hash" not in columns:  # stores made before broker credentials existed
            self._db.execute("ALTER TABLE devices ADD COLUMN broker_hash VARCHAR(200)")
        if "status" not in columns:
            self._db.execute("ALTER TABLE devices ADD COLUMN status VARCHAR(16)")
        if "last_event" not in columns:
            self._db.execute("ALTER TABLE devices ADD COLUMN last_event TEXT")
        for column in ("prefetch_name", "prefetch_version", "desired_window"):  # staged rollouts
            if column not in columns:
                self._db.execute(f"ALTER TABLE devices ADD COLUMN {column} VARCHAR(64)")
        if "desired_jitter_s" not in columns:
            self._db.execute("ALTER TABLE devices ADD COLUMN desired_jitter_s DOUBLE PRECISION")

    def close(self) -> None:
        self._db.close()

    def report(self, device_id: str, reported: dict | ReportedState) -> None:
        """What the device says it runs (its retained reported state); RefusedMessage (a
        ValueError) when it is not a valid ReportedState."""
        value = reported if isinstance(reported, ReportedState) else messages.validate("reported", reported)
        text = json.dumps(messages.stored(value))
        with self._lock:  # the same report again (a retained copy sent once more) changes nothing, last_seen neither
            self._db.execute("UPDATE devices SET reported = ?, last_seen = ? WHERE device_id = ? AND "
                             "(reported IS NULL OR reported <> ?)", (text, self.clock(), device_id, text))

    def seen(self, device_id: str, status: str) -> None:
        """Its retained status: "online", or "offline" (said on the way out, or its last will)."""
        if status not in messages.STATUSES:
            raise messages.RefusedMessage("status", f"a status is online or offline, not {status[:20]!r}")
        with self._lock:  # the same status again (a retained copy sent once more) changes nothing
            self._db.execute("UPDATE devices SET last_seen = ?, status = ? WHERE device_id = ? AND "
                             "(status IS NULL OR status <> ?)", (self.clock(), status, device_id, status))

    def event(self, device_id: str, event: dict | Event) -> None:
        """The device's latest event (say, a desired-state document it refused)."""
        value = event if isinstance(event, Event) else messages.validate("events", event)
        with self._lock:
            self._db.execute("UPDATE devices SET last_event = ? WHERE device_id = ?",
                             (json.dumps(messages.stored(value)), device_id))

    def telemetry(self, device_id: str, record: dict | TelemetryRecord) -> bool:
        """Keep one telemetry record of an enrolled device (the id is the queue's: a duplicate is
        dropped); whether it was new. Its time is the device's clock, pulled back to at most
        CLOCK_SKEW_S ahead of this one's (a record dated in the future cannot stay the newest)
        and forward to at most a week behind. A device keeps at most MAX_RECORDS_PER_DEVICE."""
        value = record if isinstance(record, TelemetryRecord) else messages.validate("telemetry", record)
        now = self.clock()
        kept = {**messages.stored(value), "id": str(value.id),
                "ts": min(max(value.ts, now - TELEMETRY_KEEP_S), now + CLOCK_SKEW_S)}
        with self._lock:
            cur = self._db.execute("INSERT INTO telemetry (device_id, record_id, ts, received_at, payload) "
                                   "SELECT ?, ?, ?, ?, ? WHERE EXISTS (SELECT 1 FROM devices WHERE device_id = ?) "
                                   "AND NOT EXISTS (SELECT 1 FROM telemetry WHERE device_id = ? AND record_id = ?)",
                                   (device_id, kept["id"], kept["ts"], now, json.dumps(kept), device_id, device_id,
                                    kept["id"]))
            if cur.rowcount:
                self._db.execute("UPDATE devices SET last_seen = ? WHERE device_id = ?", (now, device_id))
                self._inserts[device_id] = n = self._inserts.get(device_id, 0) + 1
                if n % 500 == 0:  # now and then: no device keeps more than its share, by when they came
                    self._db.execute("DELETE FROM telemetry WHERE device_id = ? AND received_at < (SELECT received_at "
                                     "FROM telemetry WHERE device_id = ? ORDER BY received_at DESC LIMIT 1 OFFSET ?)",
                                     (device_id, device_id, MAX_RECORDS_PER_DEVICE))
                if secrets.randbelow(100) == 0:  # now and then, forget what is older than a week
                    self._db.execute("DELETE FROM telemetry WHERE received_at < ?", (now - TELEMETRY_KEEP_S,))
            return cur.rowcount == 1

    @_locked
    def telemetry_window(self, device_id: str, start: float, end: float) -> list[dict]:
        """Its records from ``start`` to ``end`` (by their kept time), after the last one before
        ``start`` (the counters as the window opened), oldest first."""
        before = self._db.execute("SELECT payload FROM telemetry WHERE device_id = ? AND ts < ? "
                                  "ORDER BY ts DESC, received_at DESC LIMIT 1", (device_id, start)).fetchall()
        inside = self._db.execute("SELECT payload FROM telemetry WHERE device_id = ? AND ts >= ? AND ts <= ? "
                                  "ORDER BY ts, received_at", (device_id, start, end)).fetchall()
        return [r for r in (_kept_json(row[0]) for row in before + inside) if r is not None]

    @_locked
    def serving(self, device_id: str, window_s: float = RATE_WINDOW_S) -> dict:
        """``serving_summary`` of its newest record against the oldest one of the same agent run
        within the window."""
        row = self._db.execute("SELECT payload FROM telemetry WHERE device_id = ? ORDER BY ts DESC, received_at DESC "
                               "LIMIT 1", (device_id,)).fetchone()
        new = _kept_json(row[0]) if row else None
        if new is None:
            return {}
        ts, uptime = new.get("ts"), new.get("uptime_s")
        base = None
        if is_number(ts) and is_number(uptime):
            since = max(ts - window_s, ts - uptime)  # not before this run of the agent started
            row = self._db.execute("SELECT payload FROM telemetry WHERE device_id = ? AND ts >= ? AND ts < ? "
                                   "ORDER BY ts LIMIT 1", (device_id, since, ts)).fetchone()
            base = _kept_json(row[0]) if row else None
        return serving_summary(new, base)

    @_locked
    def add(self, device_id: str, groups: list[str], fleet: str = "default") -> str:
        """Enrol a device; returns its secret (shown once). RegistryError for a bad or taken id."""
        for what, value in [("device id", device_id), ("fleet", fleet), *(("group", g) for g in groups)]:
            if not DEVICE.fullmatch(value or ""):
                raise RegistryError(f"{what} {value!r} must be 1-64 characters of [A-Za-z0-9._-]")
        if reserved(device_id):
            raise RegistryError(f"device id {device_id!r} is reserved: names starting {RESERVED_PREFIX!r} are the "
                                "system's own (its control plane's broker user, its clients)")
        secret = secrets.token_urlsafe(24)
        try:
            with transaction(self._db, immediate=False) as db:
                db.execute("INSERT INTO devices (device_id, fleet, secret_hash, broker_hash, created_at) "
                           "VALUES (?, ?, ?, ?, ?)",
                           (device_id, fleet, _hash_secret(secret), mosquitto_hash(secret), self.clock()))
                db.executemany("INSERT INTO device_groups (device_id, group_name) VALUES (?, ?)",
                               [(device_id, g) for g in dict.fromkeys(groups)])
        except sqlite3.IntegrityError as e:
            raise RegistryError(f"device {device_id!r} is enrolled already") from e
        return secret

    @_locked
    def broker_entries(self) -> list[tuple[str, str, str]]:
        """(device, fleet, mosquitto password hash) of every device enrolled with broker credentials
        (never one under a reserved name, which a store made before they were reserved may hold)."""
        rows = self._db.execute("SELECT device_id, fleet, broker_hash FROM devices WHERE broker_hash IS NOT NULL "
                                "ORDER BY device_id").fetchall()
        return [r for r in rows if not reserved(r[0])]

    def authenticate(self, device_id: str, secret: str) -> bool | None:
        """Whether ``secret`` is the device's; None when no such device may log in (one query)."""
        if reserved(device_id):
            return None
        with self._lock:  # the lookup only: checks run side by side
            row = self._db.execute("SELECT secret_hash FROM devices WHERE device_id = ?", (device_id,)).fetchone()
        return None if row is None else check_secret(secret, row[0])

    def secret_kind(self, device_id: str) -> str | None:
        """How this device's secret is kept: "sha256" (a keyed hash), "scrypt" (a slow KDF, stores made
        before), None when no such device may log in."""
        if reserved(device_id):
            return None
        with self._lock:
            row = self._db.execute("SELECT secret_hash FROM devices WHERE device_id = ?", (device_id,)).fetchone()
        return None if row is None else row[0].partition("$")[0]

    def get(self, device_id: str) -> Device | None:
        found = self.list(device_ids=[device_id])
        return found[0] if found else None

    @_locked
    def list(self, group: str | None = None, device_ids: list[str] | None = None, serving: bool = False
             ) -> list[Device]:
        """Devices (of a group, or these ids); with ``serving``, each one's summary of its telemetry."""
        sql = ("SELECT device_id, fleet, desired_name, desired_version, desired_rev, reported, last_seen, created_at, "
               "status, last_event, prefetch_name, prefetch_version, desired_window, desired_jitter_s FROM devices")
        args: list = []
        where = ""
        if group is not None:
            where = " WHERE device_id IN (SELECT device_id FROM device_groups WHERE group_name = ?)"
            args.append(group)
        elif device_ids is not None:
            where = f" WHERE device_id IN ({', '.join('?' * len(device_ids))})"
            args += device_ids
        sql += where
        groups: dict[str, list[str]] = {}  # the groups of the devices listed only (a fleet lists one often)
        for d, g in self._db.execute(f"SELECT device_id, group_name FROM device_groups{where} ORDER BY group_name",
                                     args):
            groups.setdefault(d, []).append(g)
        out = []
        for (d, fleet, name, version, rev, reported, seen, created, status, event, pre_name, pre_version, window,
             jitter) in self._db.execute(sql + " ORDER BY device_id", args).fetchall():
            out.append(Device(d, fleet, groups.get(d, []), f"{name}@{version}" if name else None, rev,
                              _kept_reported(reported), seen, created,
                              None if status is None else status == "online",
                              self.serving(d) if serving else {}, _kept_json(event),
                              f"{pre_name}@{pre_version}" if pre_name else None, window, jitter or 0.0))
        return out

    @_locked
    def assign(self, manifest: Manifest, device_id: str | None = None, group: str | None = None,
               window: str | None = None, jitter_s: float = 0.0, device_ids: list[str] | None = None) -> list[Device]:
        """Set the desired version of one device, of ``device_ids`` or of every device of a group (a
        new revision each, all in one transaction), to activate inside ``window`` (None: at once)
        after a random wait up to ``jitter_s``; a prefetch of that same version is done with.
        RegistryError when nothing matches."""
        targets = self.list(group=group) if group is not None else \
            self.list(device_ids=device_ids if device_ids is not None else [device_id])
        if not targets:
            raise RegistryError(f"no device {device_id!r} enrolled" if group is None and device_ids is None
                                else f"no device in group {group!r}" if group is not None else "no such devices")
        with transaction(self._db, immediate=False) as db:
            db.executemany(
                "UPDATE devices SET desired_name = ?, desired_version = ?, desired_window = ?, desired_jitter_s = ?, "
                "prefetch_name = CASE WHEN prefetch_name = ? AND prefetch_version = ? THEN NULL "
                "ELSE prefetch_name END, prefetch_version = CASE WHEN prefetch_name = ? AND prefetch_version = ? "
                "THEN NULL ELSE prefetch_version END, desired_rev = desired_rev + 1 WHERE device_id = ?",
                [(manifest.name, manifest.version, window, jitter_s, *(manifest.name, manifest.version) * 2,
                  d.device_id) for d in targets])
        return self.list(device_ids=[d.device_id for d in targets])

    @_locked
    def prefetch(self, manifest: Manifest | None, device_ids: list[str], jitter_s: float = 0.0) -> None:
        """Have these devices download and verify ``manifest`` now, to activate when told (None: stop)."""
        name, version = (manifest.name, manifest.version) if manifest else (None, None)
        with transaction(self._db, immediate=False) as db:
            db.executemany("UPDATE devices SET prefetch_name = ?, prefetch_version = ?, desired_jitter_s = ?, "
                           "desired_rev = desired_rev + 1 WHERE device_id = ?",
                           [(name, version, jitter_s, d) for d in device_ids])


def reserved(name: str) -> bool:
    """A name the system uses itself (its control plane's broker user, its client ids): never a device."""
    return name.lower().startswith(RESERVED_PREFIX)


def _kept_json(text: str | None) -> dict | None:
    """A stored JSON object read back; None for what does not parse as one (a row kept before
    device messages were checked may hold NaN, or anything)."""
    if not text:
        return None
    try:
        value = wire.loads(text, limit=1 << 20)
    except wire.WireError:
        return None
    return value if isinstance(value, dict) else None


def _kept_reported(text: str | None) -> dict | None:
    """A stored reported state, as ReportedState takes it (None if it does not); a copy of a cached
    parse (the control plane lists every device twice a second, and reported states rarely change)."""
    if not text:
        return None
    parsed = _parse_reported(text)
    return None if parsed is None else dict(parsed)


@functools.lru_cache(maxsize=8192)
def _parse_reported(text: str) -> dict | None:
    value = _kept_json(text)
    try:
        return None if value is None else messages.stored(messages.validate("reported", value))
    except messages.RefusedMessage:
        return None
