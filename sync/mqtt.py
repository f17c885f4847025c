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
import random
import threading
import time
from collections import deque
from dataclasses import dataclass

import paho.mqtt.client as mqtt

from sync.queue import Item, Kind, OfflineQueue

log = logging.getLogger(__name__)

_ACKED, _LOST = "acked", "lost"


def telemetry_topic(fleet: str, device: str) -> str:
    return f"cascade/v1/{fleet}/devices/{device}/telemetry"


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


class TelemetryPublisher:
    def __init__(self, queue: OfflineQueue, config: MQTTConfig):
        self.queue, self.config = queue, config
        self.topic = telemetry_topic(config.fleet, config.device)
        self._client: mqtt.Client | None = None
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._stopping = threading.Event()
        self._events: deque[tuple[str, int]] = deque()  # (acked | lost, mid), from paho's thread
        self._inflight: dict[int, str] = {}  # mid -> item id; the publisher thread's alone while it runs
        self._drain_until = 0.0  # stop(): until when the thread waits for in-flight PUBACKs
        self._connected = False
        self._failing = False  # a connection attempt failed since the last success (log it once)
        self._connects = self._published = self._acked = self._released = 0

    # -- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background and start publishing; returns at once."""
        if self._thread is not None:
            raise RuntimeError("the telemetry publisher is already started")
        cfg = self.config
        client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=cfg.client_id, clean_session=False,
                             protocol=mqtt.MQTTv311)
        client.max_inflight_messages_set(cfg.max_inflight)
        # paho's backoff has no jitter: each device starts its doubling at a random point in [min, 2*min),
        # so a fleet that lost the broker together does not come back in lockstep
        first_s = cfg.reconnect_min_s * random.uniform(1.0, 2.0)
        client.reconnect_delay_set(min_delay=first_s, max_delay=max(first_s, cfg.reconnect_max_s))
        if cfg.username:
            client.username_pw_set(cfg.username, cfg.password or None)
        client.on_connect, client.on_connect_fail = self._on_connect, self._on_connect_fail
        client.on_disconnect, client.on_publish = self._on_disconnect, self._on_publish
        self._client = client
        self._stopping.clear()
        self._events.clear()
        self._inflight.clear()
        client.connect_async(cfg.host, cfg.port, keepalive=cfg.keepalive_s)
        client.loop_start()
        self._thread = threading.Thread(target=self._run, name=f"mqtt-telemetry-{cfg.device}", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop claiming, wait up to half of ``timeout_s`` for the PUBACKs of what is in flight,
        disconnect, and give whatever is still unacked back to the queue."""
        if self._thread is None or self._client is None:
            return
        deadline = time.monotonic() + timeout_s
        self._drain_until = time.monotonic() + timeout_s / 2
        self._stopping.set()
        self._wake.set()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            # still inside a store call: leave its state alone; the lease or recover() re-queues its items
            log.warning("the telemetry publisher thread did not stop within %.1f s", timeout_s)
        self._client.disconnect()
        self._client.loop_stop()
        self._connected = False
        if not self._thread.is_alive():
            self._settle()
            self._release(list(self._inflight.values()))
            self._inflight.clear()
        self._thread = self._client = None

    def notify(self) -> None:
        """Something new was spooled: publish now instead of at the next poll."""
        self._wake.set()

    @property
    def connected(self) -> bool:
        return self._connected

    def stats(self) -> dict:
        return {"connected": self._connected, "published": self._published, "acked": self._acked,
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
            info = self._client.publish(self.topic, encode_telemetry(item), qos=1, retain=False)
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

    # -- paho callbacks (its network thread): report, wake, return -----------------------

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.warning("MQTT broker %s:%d refused the connection: %s", self.config.host, self.config.port,
                        reason_code)
            return
        self._connects += 1
        self._connected, self._failing = True, False
        log.info("MQTT connected to %s:%d as %s (session present: %s)", self.config.host, self.config.port,
                 self.config.client_id, flags.session_present)
        self._wake.set()

    def _on_connect_fail(self, client, userdata) -> None:
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        log.log(level, "MQTT broker %s:%d unreachable; retrying", self.config.host, self.config.port)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connected = False
        dropped = client.drop_out_messages()  # the store keeps them: they are released, then published again
        self._events.extend((_LOST, m.mid) for m in dropped)
        if self._stopping.is_set():
            log.info("MQTT disconnected (%d unacked given back)", len(dropped))
        else:
            log.warning("MQTT connection to %s:%d lost (%s); %d unacked messages will be sent again",
                        self.config.host, self.config.port, reason_code, len(dropped))
        self._wake.set()

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        self._events.append((_ACKED, mid))
        self._wake.set()
