"""A device's side of desired and reported state over MQTT (topics: protocol/topics.py): it
follows its retained desired document, verified before it is believed (fleet/desired.py),
publishes its reported state and says online / offline (its last will). One identity, one
connection, shared with its telemetry publisher (sync/mqtt.py) when its owner passes ``link``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

from cascade import wire
from model_distribution.fleet.desired import AppliedDesired, BadDocument, verify_desired
from model_distribution.protocol.topics import topic
from sync.mqtt_link import LinkConfig, MQTTLink

log = logging.getLogger(__name__)


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
