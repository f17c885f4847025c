"""Desired and reported state over MQTT (QoS 1, MQTT 3.1.1).

    cascade/v1/{fleet}/devices/{device}/desired    retained, the control plane's signed document
    cascade/v1/{fleet}/devices/{device}/reported   retained, written by the device
    cascade/v1/{fleet}/devices/{device}/status     retained "online", and the last will "offline"
    cascade/v1/{fleet}/devices/{device}/telemetry  the agent's telemetry records (sync/mqtt.py), each with its id
    cascade/v1/{fleet}/devices/{device}/events     what a device wants the operator to know (a refused document)

Retained messages make it converge without replay: a device that was offline gets the latest
desired document when it subscribes again, and the control plane the latest reported state.
``DesiredPublisher`` runs in the control plane; ``DeviceStateClient`` on the device. Each is one
identity with one connection (sync/mqtt_link.py: the broker binds the client id to the user);
a device's telemetry publisher shares its connection.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cascade import wire
from model_distribution.desired import AppliedDesired, BadDocument, DesiredDocuments, verify_desired
from model_distribution.device_inbox import DeviceInbox
from model_distribution.devices import DeviceStore
from model_distribution.registry import Registry
from sync.mqtt_link import LinkConfig, MQTTLink, parse_broker_url

log = logging.getLogger(__name__)
CONTROL_PLANE_USER = "cascade-control-plane"
RESYNC_S = 300.0  # how often the control plane asks the broker for every device's retained state again


def topic(fleet: str, device: str, kind: str) -> str:
    return f"cascade/v1/{fleet}/devices/{device}/{kind}"


def broker_address(url: str) -> tuple[str, int]:
    """``mqtt://host:port`` (or ``host:port``, or ``mqtts://``) -> (host, port)."""
    host, port, _ = parse_broker_url(url)
    return host, port


class DesiredPublisher:
    """Publishes each device's signed desired document (retained) when it changes, and takes what
    devices say (through ``inbox``). The database is the truth: at each (re)connect every
    document is published again (retained, so that is idempotent), then only changed ones."""

    def __init__(self, registry: Registry, devices: DeviceStore, signing_key, broker: str, poll_s: float = 0.5,
                 client_id: str = CONTROL_PLANE_USER, username: str | None = None, password: str | None = None,
                 inbox: DeviceInbox | None = None, ca_file: str = ""):
        self.registry, self.devices, self.key = registry, devices, signing_key
        self.documents = DesiredDocuments(signing_key)
        self.inbox = inbox or DeviceInbox(devices)
        self.poll_s = poll_s
        self._published: dict[str, tuple[int, float]] = {}  # device -> (revision, signed at) sent on this connection
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.link = MQTTLink(LinkConfig.from_url(broker, username or "", password or "",
                                                 client_id=username or client_id, ca_file=ca_file, max_inflight=100,
                                                 reconnect_min_s=0.2, reconnect_max_s=5.0))
        self.link.add(self)
        for kind in ("reported", "status", "telemetry", "events"):
            self.link.subscribe(f"cascade/v1/+/devices/+/{kind}", 1, self._on_message)
        self._thread = threading.Thread(target=self._run, name="desired-publisher", daemon=True)

    def start(self) -> None:
        self.link.start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.link.stop()

    @property
    def alive(self) -> bool:
        """Its publishing thread runs (the MQTT side is paho's, which no message can end)."""
        return self._thread.is_alive()

    def on_connect(self, session_present: bool) -> None:
        with self._lock:
            self._published.clear()  # publish everything again on this connection

    def _run(self) -> None:
        resynced = time.monotonic()
        while not self._stop.wait(self.poll_s):
            try:
                self.inbox.flush()
                if self.link.connected:
                    self.publish_changes()
                    flood = self.inbox.last_flood
                    flood_over = flood is not None and resynced < flood < self.inbox.clock() - 2.0
                    if flood_over or time.monotonic() - resynced > RESYNC_S:  # (the inbox's clock is monotonic)
                        self.resync()
                        resynced = time.monotonic()
            except Exception:
                log.exception("publishing desired state failed (tried again in %.1f s)", self.poll_s)

    def resync(self) -> None:
        """Subscribe again to what devices retain (reported, status): the broker sends every retained
        copy again, so a state a broker dropped on its way here (its queue for the control plane over
        its bound while a device flooded) is kept all the same; one already kept changes nothing.
        Every RESYNC_S, and 2 s after a device stops sending past its rate."""
        self.link.client.subscribe([(f"cascade/v1/+/devices/+/{kind}", 1) for kind in ("reported", "status")])

    def publish_changes(self) -> int:
        """Publish the documents this connection has not sent in their current form; how many."""
        n = 0
        for device in self.devices.list():
            if device.desired is None:
                continue
            try:
                signed, doc = self.documents.signed(device, self.registry)
            except Exception as e:  # its version unpublished, say: the others still go out
                log.error("no desired document for %s: %s", device.device_id, e)
                continue
            if self._published.get(device.device_id) == signed:
                continue
            info = self.link.publish(topic(device.fleet, device.device_id, "desired"), doc, qos=1, retain=True)
            if info.rc == 0:
                with self._lock:
                    self._published[device.device_id] = signed
                n += 1
        return n

    def _on_message(self, message) -> None:
        parts = message.topic.split("/")
        if len(parts) != 6:
            return
        self.inbox.handle(parts[2], parts[4], parts[5], message.payload)


class DeviceStateClient:
    """A device's side: follows its desired topic (a verified document newer than the one it took
    last, which ``applied_file`` keeps across restarts, calls ``on_desired(payload)``), publishes
    its reported state (again at each reconnect), and says online / offline (its last will).
    ``link``: the device's connection, shared with its telemetry (started by its owner after
    this is built); None: one of its own."""

    def __init__(self, broker: str, fleet: str, device: str, desired_public_key: bytes,
                 on_desired: Callable[[dict], None], username: str | None = None, password: str | None = None,
                 link: MQTTLink | None = None, applied_file: Path | None = None, ca_file: str = ""):
        self.fleet, self.device = fleet, device
        self.public_key = desired_public_key
        self.on_desired = on_desired
        self.applied = AppliedDesired(applied_file)
        self.handed: tuple[int, int] | None = None  # (rev, issued_at) handed to on_desired in this run
        self.refused: list[str] = []  # why documents were refused (for the device's report)
        self._owns_link = link is None
        self.link = link or MQTTLink(LinkConfig.from_url(broker, username or device, password or "",
                                                         ca_file=ca_file, reconnect_min_s=0.2, reconnect_max_s=5.0))
        self.link.will_set(topic(fleet, device, "status"), b"offline", qos=1, retain=True)
        self.link.subscribe(topic(fleet, device, "desired"), 1, self._on_message)
        self.link.add(self)
        self.connected = threading.Event()

    def start(self) -> None:
        if self._owns_link:
            self.link.start()

    def stop(self) -> None:
        self.link.publish(topic(self.fleet, self.device, "status"), b"offline", qos=1, retain=True)
        if self._owns_link:
            self.link.stop()

    def report(self, state: dict) -> None:
        body = json.dumps({**state, "device": self.device, "at": time.time()}).encode()
        self.link.publish(topic(self.fleet, self.device, "reported"), body, qos=1, retain=True)

    def on_connect(self, session_present: bool) -> None:
        self.link.publish(topic(self.fleet, self.device, "status"), b"online", qos=1, retain=True)
        self.connected.set()

    def _on_message(self, message) -> None:
        try:
            payload = verify_desired(message.payload, self.public_key, self.device)
            newer = self.applied.judge(payload)
        except BadDocument as e:  # forged, misaddressed, too old or a replay: said on the events topic, never applied
            self._refuse(str(e))
            return
        if not newer and self.handed == (payload["rev"], payload["issued_at"]):
            return  # the same document again (a reconnect's retained copy)
        if not newer and self.handed is not None and self.handed[0] == payload["rev"]:
            self.applied.take(payload)  # the same assignment signed again: nothing to do
            return
        try:
            self.on_desired(payload)
        except Exception:  # raised on paho's thread it would never be acknowledged
            log.exception("applying desired rev %s failed; it is tried again when the broker resends it",
                          payload.get("rev"))
            return
        self.handed = (payload["rev"], payload["issued_at"])
        self.applied.take(payload)

    def _refuse(self, why: str) -> None:
        log.error("%s", why)
        self.refused.append(why)
        del self.refused[:-20]
        self.link.publish(topic(self.fleet, self.device, "events"), json.dumps(
            {"event": "desired_refused", "reason": wire.one_line(why, 900), "device": self.device,
             "at": time.time()}).encode(), qos=1)
