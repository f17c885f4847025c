"""What the embedded broker (embedded_broker.py) checks of a client before amqtt acts on it: its
login and every topic it publishes, subscribes or receives (``FleetAccessPlugin``: the DeviceStore's
credentials, the ACL of ``broker_acl.allowed``, a message rate per device), and how much it may send
(``BoundedReader``: no packet past MAX_PACKET_BYTES, bytes paced per connection)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Any

from amqtt.adapters import ReaderAdapter
from amqtt.contexts import Action
from amqtt.plugins.base import BaseAuthPlugin, BaseTopicPlugin
from amqtt.session import Session

from model_distribution.control_plane.broker_acl import MAX_PACKET_BYTES, allowed
from model_distribution.fleet.devices import DeviceStore

log = logging.getLogger(__name__)

CONTROL_PLANE = ("", "")  # the identity of the control plane user: no device, no fleet
DEVICE_RATE, DEVICE_BURST = 20.0, 200.0  # messages one device may publish a second, after a burst
INGRESS_BYTES_S, INGRESS_BURST_BYTES = 256 << 10, 4 << 20  # what one connection may send a second, after a burst


class FleetAccessPlugin(BaseAuthPlugin, BaseTopicPlugin):
    """Authentication (device secret from the DeviceStore, or the control plane's own secret; no
    anonymous) and the topic ACL, in one plugin because the ACL needs the device's fleet, which
    authentication looks up."""

    @dataclass
    class Config:
        store: Any = None  # DeviceStore
        control_plane: Any = None  # (user, secret)

    def __init__(self, context) -> None:
        super().__init__(context)
        self.store: DeviceStore = self.config.store
        self.user, self.secret = self.config.control_plane
        self.identities: dict[str, tuple[str, str]] = {}  # username -> (device, fleet), of accepted logins
        self._buckets: dict[str, tuple[float, float]] = {}  # device -> (tokens, when)
        self.dropped = 0  # device messages past their rate, not passed on

    async def authenticate(self, *, session: Session) -> bool:
        user, secret = session.username, session.password or ""
        if not user:
            log.warning("refused an anonymous client (%s)", session.client_id)
            return False
        if user == self.user:  # the control plane's name is never taken as a device's
            ok, identity = hmac.compare_digest(secret.encode(), self.secret.encode()), CONTROL_PLANE
        else:
            device = await asyncio.to_thread(self.store.get, user)
            ok = device is not None and await asyncio.to_thread(self.store.authenticate, user, secret)
            identity = (user, device.fleet) if device is not None else CONTROL_PLANE
        if not ok:
            log.warning("refused %r (%s): unknown user or wrong secret", user, session.client_id)
            return False
        if session.will_flag and not self._may(identity, session.will_topic, Action.PUBLISH):
            log.warning("refused %r: its last will goes to %s, which it may not write", user, session.will_topic)
            return False
        self.identities[user] = identity
        return True

    async def topic_filtering(self, *, session: Session | None = None, topic: str | None = None,
                              action: Action | None = None) -> bool:
        identity = self.identities.get(session.username) if session is not None and session.username else None
        if identity is None or not topic or not self._may(identity, topic, action):
            return False
        if action == Action.PUBLISH and identity[0]:  # a device's message: within its rate, or not passed on
            return self._within_rate(identity[0])
        return True

    def _within_rate(self, device: str) -> bool:
        """A device may publish DEVICE_RATE messages a second after DEVICE_BURST: far above what an agent
        sends (a record every 30 s, a dozen reports a change), far below a flood, which would otherwise
        reach the control plane's connection (and this process's memory) at the socket's speed."""
        now = time.monotonic()
        tokens, at = self._buckets.get(device, (DEVICE_BURST, now))
        tokens = min(DEVICE_BURST, tokens + (now - at) * DEVICE_RATE)
        if len(self._buckets) >= 200_000 and device not in self._buckets:
            self._buckets.clear()
        self._buckets[device] = (tokens - 1.0 if tokens >= 1.0 else tokens, now)
        if tokens < 1.0:
            self.dropped += 1
        return tokens >= 1.0

    @staticmethod
    def _may(identity: tuple[str, str], topic: str, action: Action) -> bool:
        device, fleet = identity
        return allowed(str(action), topic, device or None, fleet or None)


class PacketTooLarge(Exception):
    """A client declared a packet past MAX_PACKET_BYTES."""


class BoundedReader(ReaderAdapter):
    """A connection's reader that will not read a packet larger than MAX_PACKET_BYTES (as Mosquitto's
    ``max_packet_size``): amqtt would buffer whatever length a client declares; here the
    connection is closed instead."""

    def __init__(self, inner: ReaderAdapter, on_login=None, key: int = 0):
        self._inner = inner
        self._on_login, self._key = on_login, key
        self._tokens, self._at = float(INGRESS_BURST_BYTES), time.monotonic()

    def unpaced(self) -> None:
        self._tokens = float("inf")
        self._at = float("inf")

    def logged_in(self) -> None:
        if self._on_login is not None:
            self._on_login(self._key)
            self._on_login = None

    async def read(self, n: int = -1) -> bytes:
        if n > MAX_PACKET_BYTES:  # amqtt's reader loop ends (closing the connection) on an exception it does not know
            raise PacketTooLarge(f"a packet of more than {MAX_PACKET_BYTES} bytes: connection closed")
        if n > 0 and self._tokens != float("inf"):
            # paced: a connection reads at most INGRESS_BYTES_S after its burst, so a flood backs up in its own
            # socket (TCP pushes back on the sender) instead of in this process's queues (amqtt bounds none: a
            # 30 s flood of 24 kB messages grew the control plane by 2.4 GB)
            now = time.monotonic()
            self._tokens = min(INGRESS_BURST_BYTES, self._tokens + (now - self._at) * INGRESS_BYTES_S)
            self._at = now
            if self._tokens < n:
                await asyncio.sleep((n - self._tokens) / INGRESS_BYTES_S)
                self._tokens, self._at = float(n), time.monotonic()
            self._tokens -= n
        return await self._inner.read(n)

    def feed_eof(self) -> None:
        self._inner.feed_eof()
