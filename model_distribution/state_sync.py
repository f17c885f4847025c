"""Desired and reported state over MQTT (QoS 1, MQTT 3.1.1).

    cascade/v1/{fleet}/devices/{device}/desired    retained, the control plane's signed document
    cascade/v1/{fleet}/devices/{device}/reported   retained, written by the device
    cascade/v1/{fleet}/devices/{device}/status     retained "online", and the last will "offline"
    cascade/v1/{fleet}/devices/{device}/telemetry  the agent's telemetry records (sync/mqtt.py), each with its id
    cascade/v1/{fleet}/devices/{device}/events     what a device wants the operator to know (a refused document)

Retained messages make it converge without replay: a device that was offline gets the latest
desired document when it subscribes again, and the control plane the latest reported state.
``DesiredPublisher`` runs in the control plane; ``DeviceStateClient`` on the device.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt

from model_distribution.devices import BadDocument, Device, DeviceStore, desired_document, verify_desired
from model_distribution.registry import Registry

log = logging.getLogger(__name__)


def topic(fleet: str, device: str, kind: str) -> str:
    return f"cascade/v1/{fleet}/devices/{device}/{kind}"


def broker_address(url: str) -> tuple[str, int]:
    """``mqtt://host:port`` (or ``host:port``) -> (host, port)."""
    parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    if parts.scheme not in ("mqtt", "tcp") or not parts.hostname:
        raise ValueError(f"broker URL {url!r} must be mqtt://HOST[:PORT]")
    return parts.hostname, parts.port or 1883


def _client(client_id: str, username: str | None = None, password: str | None = None) -> mqtt.Client:
    c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=client_id, clean_session=False,
                    protocol=mqtt.MQTTv311)
    c.reconnect_delay_set(min_delay=0.2, max_delay=5.0)
    c.max_inflight_messages_set(100)
    if username:
        c.username_pw_set(username, password)
    return c


class DesiredDocuments:
    """Each device's signed desired document, signed once per desired revision and kept, so the
    retained message (published again at each reconnect) and the control plane's HTTP fallback
    (``GET /v1/devices/{device}/desired``) are the same bytes."""

    def __init__(self, signing_key):
        self.key = signing_key
        self._signed: dict[str, tuple[int, bytes]] = {}  # device -> (revision, its document)
        self._lock = threading.Lock()

    def get(self, device: Device, registry: Registry) -> bytes:
        """Its document (RegistryError when its desired version is not published)."""
        with self._lock:
            rev, doc = self._signed.get(device.device_id, (-1, b""))
            if rev != device.desired_rev:
                prefetch = registry.resolve(device.prefetch) if device.prefetch else None
                doc = desired_document(device, registry.resolve(device.desired), self.key, prefetch)
                self._signed[device.device_id] = (device.desired_rev, doc)
            return doc


class DesiredPublisher:
    """Publishes each device's signed desired document (retained) when its revision changes, and
    records what devices report. The database is the truth: at each (re)connect every document
    is published again (retained, so that is idempotent), then only new revisions."""

    def __init__(self, registry: Registry, devices: DeviceStore, signing_key, broker: str, poll_s: float = 0.5,
                 client_id: str = "cascade-control-plane", username: str | None = None, password: str | None = None):
        self.registry, self.devices, self.key = registry, devices, signing_key
        self.documents = DesiredDocuments(signing_key)
        self.poll_s = poll_s
        self._host, self._port = broker_address(broker)
        self._published: dict[str, int] = {}  # device -> revision published on this connection
        self._connected = threading.Event()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.client = _client(client_id, username, password)
        self.client.on_connect = self._on_connect
        self.client.on_disconnect = lambda *a: self._connected.clear()
        self.client.on_message = self._on_message
        self._thread = threading.Thread(target=self._run, name="desired-publisher", daemon=True)

    def start(self) -> None:
        self.client.connect_async(self._host, self._port, keepalive=30)
        self.client.loop_start()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("the broker refused the control plane: %s", reason_code)
            return
        client.subscribe([("cascade/v1/+/devices/+/reported", 1), ("cascade/v1/+/devices/+/status", 1),
                          ("cascade/v1/+/devices/+/telemetry", 1), ("cascade/v1/+/devices/+/events", 1)])
        with self._lock:
            self._published.clear()  # publish everything again on this connection
        self._connected.set()

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self._connected.is_set():
                try:
                    self.publish_changes()
                except Exception:
                    log.exception("publishing desired state failed")

    def publish_changes(self) -> int:
        """Publish the documents whose revision this connection has not sent yet; how many."""
        n = 0
        for device in self.devices.list():
            if device.desired is None or self._published.get(device.device_id) == device.desired_rev:
                continue
            doc = self.documents.get(device, self.registry)
            info = self.client.publish(topic(device.fleet, device.device_id, "desired"), doc, qos=1, retain=True)
            if info.rc == mqtt.MQTT_ERR_SUCCESS:
                with self._lock:
                    self._published[device.device_id] = device.desired_rev
                n += 1
        return n

    def _on_message(self, client, userdata, message) -> None:
        parts = message.topic.split("/")
        if len(parts) != 6:
            return
        device, kind = parts[4], parts[5]
        try:
            if kind == "reported":
                self.devices.report(device, json.loads(message.payload))
            elif kind == "status":
                self.devices.seen(device, message.payload.decode(errors="replace"))
            elif kind == "telemetry":
                self.devices.telemetry(device, json.loads(message.payload))
            elif kind == "events":
                event = json.loads(message.payload)
                self.devices.event(device, event)
                log.warning("device %s: %s", device, event)
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # a device's message, whatever it holds
            log.warning("unreadable %s from %s: %s", kind, device, e.__class__.__name__ if isinstance(
                e, RecursionError) else e)


class DeviceStateClient:
    """A device's side: follows its desired topic (a verified document with a newer revision calls
    ``on_desired(payload)``), publishes its reported state, and says online / offline (last will)."""

    def __init__(self, broker: str, fleet: str, device: str, desired_public_key: bytes,
                 on_desired: Callable[[dict], None], username: str | None = None, password: str | None = None):
        self.fleet, self.device = fleet, device
        self.public_key = desired_public_key
        self.on_desired = on_desired
        self.applied_rev = 0
        self.refused: list[str] = []  # why documents were refused (for the device's report)
        self._host, self._port = broker_address(broker)
        self.client = _client(f"cascade-device-{fleet}-{device}", username or device, password)
        self.client.will_set(topic(fleet, device, "status"), b"offline", qos=1, retain=True)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.connected = threading.Event()

    def start(self) -> None:
        self.client.connect_async(self._host, self._port, keepalive=30)
        self.client.loop_start()

    def stop(self) -> None:
        self.client.publish(topic(self.fleet, self.device, "status"), b"offline", qos=1, retain=True)
        self.client.disconnect()
        self.client.loop_stop()

    def report(self, state: dict) -> None:
        body = {**state, "device": self.device, "at": time.time()}
        self.client.publish(topic(self.fleet, self.device, "reported"), json.dumps(body).encode(), qos=1,
                            retain=True)

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("the broker refused this device: %s", reason_code)
            return
        client.subscribe(topic(self.fleet, self.device, "desired"), qos=1)
        client.publish(topic(self.fleet, self.device, "status"), b"online", qos=1, retain=True)
        self.connected.set()

    def _on_message(self, client, userdata, message) -> None:
        try:
            payload = verify_desired(message.payload, self.public_key, self.device)
        except BadDocument as e:  # forged or misaddressed: said on the events topic, never applied
            log.error("%s", e)
            self.refused.append(str(e))
            self.client.publish(topic(self.fleet, self.device, "events"), json.dumps(
                {"event": "desired_refused", "reason": str(e), "device": self.device, "at": time.time()}).encode(),
                qos=1)
            return
        rev = payload.get("rev")
        if not isinstance(rev, int) or rev <= self.applied_rev:
            return  # an older (or the same) assignment: nothing to do
        try:
            self.on_desired(payload)
        except Exception:  # raised on paho's thread it would end this device's MQTT loop for good
            log.exception("applying desired rev %d failed; it is tried again when the broker resends it", rev)
            return
        self.applied_rev = rev
