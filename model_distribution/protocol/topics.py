"""The fleet's MQTT topics (QoS 1, MQTT 3.1.1), the one naming both ends use.

    cascade/v1/{fleet}/devices/{device}/desired    retained, the control plane's signed document
    cascade/v1/{fleet}/devices/{device}/reported   retained, written by the device
    cascade/v1/{fleet}/devices/{device}/status     retained "online", and the last will "offline"
    cascade/v1/{fleet}/devices/{device}/telemetry  the agent's telemetry records (sync/mqtt.py), each with its id
    cascade/v1/{fleet}/devices/{device}/events     what a device wants the operator to know (a refused document)
"""

from __future__ import annotations

from sync.mqtt_link import device_topic

CONTROL_PLANE_USER = "cascade-control-plane"
DEVICE_WRITES = ("reported", "events", "status", "telemetry")  # what a device publishes (and the broker lets it)


def topic(fleet: str, device: str, kind: str) -> str:
    """One device's topic of ``kind`` (sync's scheme: its telemetry publisher uses the same)."""
    return device_topic(fleet, device, kind)

