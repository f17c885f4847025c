"""Telemetry over MQTT: the outbox's telemetry published at QoS 1, deleted only on the broker's PUBACK.

One publisher thread owns the round: while the client is connected it claims telemetry from the
``OfflineQueue``, publishes each item (its id inside, so consumers can drop duplicates) and keeps
``mid -> item id`` for what is in flight, never more than ``max_inflight``. paho's network thread
only reports: its callbacks append events (a PUBACK, a message given up on disconnect) and wake
the publisher thread, which settles them in the store, a batch of acks in one transaction.
Keeping the store and the map on one thread settles paho's race where ``on_publish`` fires before
``publish()`` has returned the mid (an event is only read after its mid is recorded), without a
lock of ours around ``publish()``: that lock would be taken in the opposite order to paho's own
(paho holds its out-message lock while it calls ``on_publish``), a deadlock.

Disconnects: the store is the only copy that outlives a connection. On disconnect the unacked
messages are taken out of paho (``drop_out_messages``) and their items released back to ``queued``;
after the reconnect they are claimed and published again with new mids. Nothing is claimed while
disconnected, so paho's memory stays bounded and a claimed item waits for its PUBACK only on a live
connection (which keepalive bounds), well inside the lease. Duplicates are possible (the broker may
have had a message whose PUBACK was lost with the connection) and bounded by ``max_inflight`` per
disconnect; losses are not: an item leaves the store only on its PUBACK. Items re-claimed while still
in flight (their lease ran out) are not published twice. ``stop()`` waits a little for the PUBACKs of
what is in flight and releases the rest; a process that dies leaves its items ``sending`` until
``OfflineQueue.recover()`` at the next start-up (the publisher never calls it: it would also
re-queue requests being delivered by someone else).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass

import paho.mqtt.client as mqtt

from sync.mqtt_link import LinkConfig, MQTTLink, device_topic
from sync.queue import Item, Kind, OfflineQueue

log = logging.getLogger(__name__)

_ACKED, _LOST = "acked", "lost"


def telemetry_topic(fleet: str, device: str) -> str:
    return device_topic(fleet, device, "telemetry")


def encode_telemetry(item: Item) -> bytes:
    """The wire form of one telemetry item: its payload as compact JSON, with the item's id."""
    body = {"id": item.id, **item.payload}
    body["id"] = item.id  # the queue's id is the dedupe key: a payload field of that name cannot shadow it
    return json.dumps(body, separators=(",", ":")).encode()


@dataclass
class MQTTConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    fleet: str = "default"
    device: str = ""  # a topic segment: required
    client_id: str = ""  # "" -> f"cascade-{fleet}-{device}": stable, so the broker keeps the session
    keepalive_s: int = 30
    username: str = ""
    password: str = ""
    tls: bool = False  # mqtts: the broker's certificate checked against ca_file (or the system's CAs)
    ca_file: str = ""
    max_inflight: int = 20  # published and not yet acknowledged
    batch_size: int = 50  # telemetry rows claimed per round
    poll_s: float = 2.0  # longest idle wait (notify() wakes the publisher at once)
    lease_s: float = 600.0  # a claimed item returns to the queue if neither acked nor released by then
    reconnect_min_s: float = 1.0  # the first wait (jittered up to 2x), doubled after each failed attempt
    reconnect_max_s: float = 30.0

    def __post_init__(self):
        for name in ("fleet", "device"):
            value = getattr(self, name)
            if not value or any(c in value for c in "/+#"):
                raise ValueError(f"{name} must be a non-empty topic segment without '/', '+' or '#': {value!r}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.max_inflight < 1 or self.batch_size < 1:
            raise ValueError("max_inflight and batch_size must be >= 1")
        if self.keepalive_s < 1 or self.poll_s <= 0 or self.reconnect_min_s <= 0:
            raise ValueError("keepalive_s, poll_s and reconnect_min_s must be > 0")
        if self.reconnect_max_s < self.reconnect_min_s:
            raise ValueError("reconnect_max_s must be >= reconnect_min_s")
        if self.lease_s <= 2 * self.keepalive_s:
            raise ValueError("lease_s must exceed twice keepalive_s (a dead connection is noticed within 1.5x)")
        self.client_id = self.client_id or f"cascade-{self.fleet}-{self.device}"

    def link_config(self) -> LinkConfig:
        return LinkConfig(host=self.host, port=self.port, client_id=self.client_id, username=self.username,
                          password=self.password, tls=self.tls, ca_file=self.ca_file, keepalive_s=self.keepalive_s,
                          max_inflight=self.max_inflight, reconnect_min_s=self.reconnect_min_s,
                          reconnect_max_s=self.reconnect_max_s)


class TelemetryPublisher:
    """Publishes the outbox's telemetry (see the module docstring) on its own connection, or on
    ``link``, the one connection of its identity that other parts share (then its owner starts
    and stops the link, and ``start`` must come before the link's)."""

    def __init__(self, queue: OfflineQueue, config: MQTTConfig, link: MQTTLink | None = None):
        self.queue, self.config = queue, config
        self.topic = telemetry_topic(config.fleet, config.device)
        self._link = link
        self._owns_link = link is None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._events: deque[tuple[str, int]] = deque()  # (acked | lost, mid), from paho's thread
        self._inflight: dict[int, str] = {}  # mid -> item id; the publisher thread's alone while it runs
        self._drain_until = 0.0  # stop(): until when the thread waits for in-flight PUBACKs
        self._connects = self._published = self._acked = self._released = 0

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background (or join the shared link) and start publishing; returns at once."""
        if self._thread is not None:
            raise RuntimeError("the telemetry publisher is already started")
        if self._owns_link:
            self._link = MQTTLink(self.config.link_config())
        self._stopping.clear()
        self._events.clear()
        self._inflight.clear()
        self._link.add(self)
        if self._owns_link:
            self._link.start()
        self._thread = threading.Thread(target=self._run, name=f"mqtt-telemetry-{self.config.device}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop claiming, wait up to half of ``timeout_s`` for the PUBACKs of what is in flight,
        disconnect (its own link), and give whatever is still unacked back to the queue."""
        if self._thread is None or self._link is None:
            return
        deadline = time.monotonic() + timeout_s
        self._drain_until = time.monotonic() + timeout_s / 2
        self._stopping.set()
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            # still inside a store call: leave its state alone; the lease or recover() re-queues its items
            log.warning("the telemetry publisher thread did not stop within %.1f s", timeout_s)
        if self._owns_link:
            self._link.stop()
        if not self._thread.is_alive():
            self._settle()
            self._release(list(self._inflight.values()))
            self._inflight.clear()
        self._thread = None
        if self._owns_link:
            self._link = None

    def notify(self) -> None:
        """Something new was spooled: publish now instead of at the next poll."""
        self._wake.set()

    @property
    def connected(self) -> bool:
        return self._link is not None and self._link.connected

    @property
    def _connected(self) -> bool:
        return self.connected

    def stats(self) -> dict:
        return {"connected": self.connected, "published": self._published, "acked": self._acked,
                "released": self._released, "reconnects": max(0, self._connects - 1),
                "in_flight": len(self._inflight)}

    # -- the publisher thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            self._wake.clear()  # before looking, so a wake-up during the round is not missed
            wait_s = self.config.poll_s
            try:
                self._settle()
                if self._stopping.is_set():  # no more claims; wait a little for what is in flight
                    wait_s = self._drain_until - time.monotonic()
                    if not (self._inflight and self._connected) or wait_s <= 0:
                        return
                elif self._publish_round():
                    continue
            except Exception:  # the store failed (disk full, locked): log it, and try again after a poll
                log.exception("telemetry round failed")
            self._wake.wait(wait_s)

    def _publish_round(self) -> bool:
        """Claim and publish what fits in flight. True when a full batch went out (look again at once)."""
        room = self.config.max_inflight - len(self._inflight)
        if not self._connected or room <= 0:
            return False
        limit = min(room, self.config.batch_size)
        items = self.queue.claim(Kind.TELEMETRY, limit, lease_s=self.config.lease_s)
        in_flight = set(self._inflight.values())
        for item in items:
            if item.id in in_flight:  # its lease ran out while it awaits its PUBACK: the claim renewed it
                continue
            info = self._link.publish(self.topic, encode_telemetry(item), qos=1, retain=False)
            if info.rc == mqtt.MQTT_ERR_QUEUE_SIZE:  # paho did not keep it (mid still in use)
                self._release([item.id])
                continue
            # any other rc (NO_CONN included): paho holds the message and sends it once connected
            self._inflight[info.mid] = item.id
            self._published += 1
        return len(items) == limit

    def _settle(self) -> None:
        """Apply what paho reported: acked items are deleted, lost ones go back to the queue.
        Mids leave the map first: if the store call fails, the lease re-queues those items."""
        acked, lost = [], []
        while self._events:
            event, mid = self._events.popleft()
            item_id = self._inflight.pop(mid, None)
            if item_id is not None:
                (acked if event == _ACKED else lost).append(item_id)
        if acked:
            self.queue.ack(acked)
            self._acked += len(acked)
        self._release(lost)

    def _release(self, item_ids: list[str]) -> None:
        if item_ids:
            self.queue.release(item_ids)
            self._released += len(item_ids)

    # -- the link's callbacks (paho's network thread): report, wake, return ----------------

    def on_connect(self, session_present: bool) -> None:
        self._connects += 1
        self._wake.set()

    def on_dropped(self, messages: list) -> set[int]:
        """The connection was lost: the unacked telemetry goes back to the queue (the store is the
        only copy that outlives a connection), to be claimed and published again after the reconnect."""
        mine = {m.mid for m in messages if m.topic == self.topic}
        self._events.extend((_LOST, mid) for mid in mine)
        if self._stopping.is_set():
            log.info("MQTT disconnected (%d unacked given back)", len(mine))
        self._wake.set()
        return mine

    def on_publish(self, mid: int) -> None:
        self._events.append((_ACKED, mid))
        self._wake.set()
