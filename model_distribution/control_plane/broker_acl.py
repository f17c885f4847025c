"""What a client of the fleet's broker may do, the one rule both brokers keep: Mosquitto through
the ACL file ``mosquitto_files.broker_files`` writes, the embedded broker (embedded_broker.py)
by asking ``allowed`` at each publish, subscribe and delivery."""

from __future__ import annotations

from model_distribution.protocol.topics import DEVICE_WRITES
from model_distribution.protocol.topics import topic as device_topic

MAX_PACKET_BYTES = 64 << 10  # the largest packet either broker takes: a device's messages are a few kB (32 kB at most)


def allowed(action: str, topic: str, device: str | None, fleet: str | None) -> bool:
    """May this client do ``action`` ("publish", "subscribe" or "receive") on ``topic`` (a topic
    filter for "subscribe")? ``device`` None is the control plane."""
    if device is None:
        return topic == "cascade/v1" or topic.startswith("cascade/v1/")
    if action == "publish":
        return topic in {device_topic(fleet, device, kind) for kind in DEVICE_WRITES}
    return topic == device_topic(fleet, device, "desired")
