"""The control plane's side of desired and reported state over MQTT (topics: protocol/topics.py).

Retained messages make it converge without replay: a device that was offline gets the latest
desired document when it subscribes again, and the control plane the latest reported state.
``DesiredPublisher`` is one identity with one connection (sync/mqtt_link.py: the broker binds the
client id to the user); the device's side is device/state_client.py.
"""

from __future__ import annotations

import logging
import threading
import time

from model_distribution.control_plane.inbox import DeviceInbox
from model_distribution.fleet.desired import DesiredDocuments
from model_distribution.fleet.devices import DeviceStore
from model_distribution.protocol.topics import CONTROL_PLANE_USER, DEVICE_WRITES, topic
from model_distribution.registry.store import Registry
from sync.mqtt_link import LinkConfig, MQTTLink

log = logging.getLogger(__name__)
RESYNC_S = 300.0  # how often the control plane asks the broker for every device's retained state again


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
        for kind in DEVICE_WRITES:
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
        self.link.resubscribe([f"cascade/v1/+/devices/+/{kind}" for kind in ("reported", "status")])

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
