"""Where what devices say arrives at the control plane, over MQTT and over HTTP alike.

``DeviceInbox.handle(fleet, device, kind, payload)`` takes one message: the device must be
enrolled in that fleet; the payload goes through the one codec (device_messages.decode) into
the DeviceStore. It never raises: a message that is refused, or that the store fails to keep, is
logged (at most once a minute per device) and counted, and the caller acknowledges it, so a
poison message is never delivered again and again, and no message can end the MQTT listener.

No device takes what another gets: each device has a token bucket (``burst`` messages, then
``rate`` a second). Past it, telemetry and events are dropped (counted; telemetry counters are
cumulative, so a later record makes up for a dropped one) and a reported state or status is held,
the latest per device, and kept by ``flush()`` (the publisher's loop, twice a second): states are
coalesced, so a device's final state is never lost to its own flood, its writes stay bounded
(two a flush at most), and no flood delays another device's messages.

    cascade_fleet_device_messages_total{kind}                 messages taken (MQTT and HTTP)
    cascade_fleet_device_messages_refused_total{kind,reason}  refused: the codec's reason, unknown_device,
                                                              rate (dropped), error (the store failed)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter

from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol import device_messages as messages
from model_distribution.protocol.device_messages import KINDS, RefusedMessage

log = logging.getLogger(__name__)
LATEST_ONLY = ("reported", "status")  # states: only the newest matters, so these are held, never dropped
KNOWN_TTL_S, UNKNOWN_TTL_S = 60.0, 5.0
MAX_TRACKED = 200_000  # devices with a bucket, a held message or a cached enrolment


class DeviceInbox:
    def __init__(self, store: DeviceStore, metrics: CollectorRegistry | None = None, rate: float = 2.0,
                 burst: float = 120.0, clock: Callable[[], float] = time.monotonic):
        self.store, self.rate, self.burst, self.clock = store, rate, burst, clock
        registry = metrics if metrics is not None else CollectorRegistry()
        self.taken = Counter("cascade_fleet_device_messages", "Device messages taken, by kind (MQTT and HTTP)",
                             ["kind"], registry=registry)
        self.refused = Counter("cascade_fleet_device_messages_refused",
                               "Device messages refused or dropped, by kind and reason", ["kind", "reason"],
                               registry=registry)
        self._buckets: dict[str, tuple[float, float]] = {}  # device -> (tokens, at)
        self._held: dict[str, dict[str, tuple[str, bytes]]] = {}  # device -> kind -> (fleet, its payload)
        self._enrolled: dict[str, tuple[str | None, float]] = {}  # device -> (its fleet or None, until)
        self._logged: dict[str, float] = {}  # device -> when it was last logged
        self.last_flood: float | None = None  # when a device last sent past its rate (its clock)
        self._lock = threading.Lock()

    # -- taking a message ------------------------------------------------------------------

    def handle(self, fleet: str, device: str, kind: str, payload: bytes) -> str:
        """Take one message from MQTT; what became of it ("recorded", "duplicate", "held", or the
        reason it was refused). Never raises."""
        try:
            return self._handle(fleet, device, kind, payload)
        except Exception as e:  # a bug of ours must not end the listener either
            log.exception("a %s message from %s could not be handled", kind, device[:64])
            self._count_refused(kind, "error", device, str(e))
            return "error"

    def _handle(self, fleet: str, device: str, kind: str, payload: bytes) -> str:
        kind = kind if kind in KINDS else "other"
        if kind == "other":
            return self._refuse(kind, "topic", device, "not a device topic")
        if self._fleet_of(device) != fleet:
            return self._refuse(kind, "unknown_device", device, f"no device {device[:64]!r} enrolled in {fleet[:64]!r}")
        if not self._take_token(device):  # before any parsing: a flood costs a lookup a message
            self.last_flood = self.clock()
            if kind in LATEST_ONLY:
                with self._lock:
                    self._held.setdefault(device, {})[kind] = (fleet, bytes(payload))
                return "held"
            return self._refuse(kind, "rate", device, f"over {self.rate:g} messages/s (burst {self.burst:g})")
        return self._decode_and_keep(device, kind, payload, fleet)

    def _decode_and_keep(self, device: str, kind: str, payload: bytes, fleet: str | None) -> str:
        try:
            value = messages.decode(kind, payload)
        except RefusedMessage as e:
            return self._refuse(kind, e.reason, device, str(e))
        self.taken.labels(kind).inc()
        return self._keep(device, kind, value, fleet)

    def receive(self, device: str, kind: str, payload: bytes) -> None:
        """Take one message from HTTP (the device is authenticated already): RefusedMessage (reason
        "rate" for a device over its rate: the caller answers 429) when it is not kept."""
        try:
            value = messages.decode(kind, payload)
        except RefusedMessage as e:
            self._count_refused(kind, e.reason, device, str(e))
            raise
        self.taken.labels(kind).inc()
        if not self._take_token(device):
            self._count_refused(kind, "rate", device, "over its rate")
            raise RefusedMessage("rate", f"more than {self.rate:g} messages a second (burst {self.burst:g}) from "
                                         f"{device!r}: try again in a few seconds")
        if self._keep(device, kind, value, None) == "error":
            raise RuntimeError(f"the {kind} of {device!r} could not be stored")

    def flush(self) -> int:
        """Keep the held states (the latest of each kind per device); how many were kept."""
        with self._lock:
            devices = list(self._held)
        kept = 0
        for device in devices:
            with self._lock:
                held = self._held.pop(device, {})
            for kind, (fleet, payload) in held.items():
                if self._decode_and_keep(device, kind, payload, fleet) == "recorded":
                    kept += 1
        return kept

    # -- the parts -------------------------------------------------------------------------

    def _keep(self, device: str, kind: str, value, fleet: str | None) -> str:
        try:
            if kind == "reported":
                self.store.report(device, value)
            elif kind == "status":
                self.store.seen(device, value)
            elif kind == "telemetry":
                return "recorded" if self.store.telemetry(device, value) else "duplicate"
            else:
                self.store.event(device, value)
                log.warning("device %s: %s %s", device, value.event, value.reason or "")
            return "recorded"
        except Exception as e:  # the store failed (locked, disk full): a state is tried again, the rest counted
            if kind in LATEST_ONLY and fleet is not None:
                with self._lock:
                    self._held.setdefault(device, {}).setdefault(kind, (fleet, messages.encode(value)))
            self._count_refused(kind, "error", device, f"not stored: {e}")
            return "error"

    def _refuse(self, kind: str, reason: str, device: str, why: str) -> str:
        self._count_refused(kind, reason, device, why)
        return reason

    def _count_refused(self, kind: str, reason: str, device: str, why: str) -> None:
        self.refused.labels(kind if kind in KINDS else "other", reason).inc()
        now = self.clock()
        with self._lock:
            quiet = now - self._logged.get(device, -1e9) < 60.0
            if not quiet:
                if len(self._logged) >= MAX_TRACKED:
                    self._logged.clear()
                self._logged[device] = now
        if not quiet:  # one line a minute per device, however much it sends; the counter counts them all
            log.warning("refused a %s message from %r (%s): %s", kind, device[:64], reason, why[:300])

    def _take_token(self, device: str) -> bool:
        now = self.clock()
        with self._lock:
            tokens, at = self._buckets.get(device, (self.burst, now))
            tokens = min(self.burst, tokens + (now - at) * self.rate)
            if len(self._buckets) >= MAX_TRACKED and device not in self._buckets:
                self._buckets.clear()
            ok = tokens >= 1.0
            self._buckets[device] = (tokens - 1.0 if ok else tokens, now)
        return ok

    def _fleet_of(self, device: str) -> str | None:
        """The fleet ``device`` is enrolled in (None: not enrolled), from a cache of the store."""
        now = self.clock()
        with self._lock:
            fleet, until = self._enrolled.get(device, (None, -1.0))
        if until > now:
            return fleet
        found = self.store.get(device) if len(device) <= 64 else None
        fleet = found.fleet if found is not None else None
        with self._lock:
            if len(self._enrolled) >= MAX_TRACKED:
                self._enrolled.clear()
            self._enrolled[device] = (fleet, now + (KNOWN_TTL_S if fleet is not None else UNKNOWN_TTL_S))
        return fleet
