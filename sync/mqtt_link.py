"""One MQTT connection per identity: what a device (its telemetry and its desired/reported state)
and the control plane each hold to the broker.

A broker binds a connection's client id to its authenticated user (Mosquitto's
``use_username_as_clientid``, the embedded broker likewise), so one identity gets exactly one
connection: a second one with the same user would take the first one's session over. Everything
a process says as that identity goes through one ``MQTTLink``; its parts register with it:

    link = MQTTLink(LinkConfig.from_url("mqtts://broker:8883", "kiosk-7", secret, ca_file=...))
    link.will_set(status_topic, b"offline")          # before start
    link.subscribe("cascade/v1/f/devices/kiosk-7/desired", 1, on_message)
    link.add(peer)        # peer.on_connect(session_present), .on_dropped(messages) -> kept, .on_publish(mid)
    link.start(); ...; link.stop()

Connections are persistent sessions (clean_session false), reconnect with jittered exponential
backoff, and may use TLS (``mqtts://``: the broker's certificate checked against ``ca_file``, or
the system's CAs). On a lost connection paho's unacknowledged messages are taken out of it
(``drop_out_messages``) and offered to the peers: a peer that keeps its own copy (the telemetry
publisher's outbox) takes its own; the rest are published again, in order, after the reconnect
(of retained messages only the latest per topic). No callback of a peer can end paho's loop: an
exception is logged and the message is acknowledged.
"""

from __future__ import annotations

import logging
import random
import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

import paho.mqtt.client as mqtt

log = logging.getLogger(__name__)

SCHEMES = {"mqtt": False, "tcp": False, "mqtts": True, "ssl": True, "tls": True}
MAX_RESEND = 256  # messages kept across a lost connection for the peers that keep no copy


def device_topic(fleet: str, device: str, kind: str) -> str:
    """The one topic scheme of a device's messages: ``cascade/v1/{fleet}/devices/{device}/{kind}``
    (telemetry here, desired/reported/status/events in model_distribution)."""
    return f"cascade/v1/{fleet}/devices/{device}/{kind}"


def parse_broker_url(url: str) -> tuple[str, int, bool]:
    """``mqtt://host[:1883]`` or ``mqtts://host[:8883]`` (``host:port`` alone is mqtt) -> (host, port, tls);
    ValueError otherwise."""
    parts = urlsplit(url if "://" in url else f"mqtt://{url}")
    if parts.scheme not in SCHEMES or not parts.hostname:
        raise ValueError(f"broker URL {url!r} must be mqtt://HOST[:PORT] or mqtts://HOST[:PORT]")
    tls = SCHEMES[parts.scheme]
    try:
        port = parts.port or (8883 if tls else 1883)
    except ValueError as e:
        raise ValueError(f"broker URL {url!r}: {e}") from None
    return parts.hostname, port, tls


@dataclass
class LinkConfig:
    host: str = "127.0.0.1"
    port: int = 1883
    client_id: str = ""  # "" -> the username (the identity the broker binds it to)
    username: str = ""
    password: str = ""
    tls: bool = False
    ca_file: str = ""  # with tls: the CA bundle the broker's certificate is checked against ("": the system's)
    keepalive_s: int = 30
    max_inflight: int = 20
    reconnect_min_s: float = 1.0  # the first wait (jittered up to 2x), doubled after each failed attempt
    reconnect_max_s: float = 30.0

    def __post_init__(self):
        self.client_id = self.client_id or self.username
        if not self.client_id:
            raise ValueError("an MQTT link needs a client id or a username")
        if not 0 < self.port < 65536:
            raise ValueError(f"port out of range: {self.port}")
        if self.ca_file and not self.tls:
            raise ValueError("a CA file is for a TLS broker (mqtts://)")

    @classmethod
    def from_url(cls, url: str, username: str = "", password: str = "", **kw) -> LinkConfig:
        host, port, tls = parse_broker_url(url)
        return cls(host=host, port=port, tls=tls, username=username, password=password, **kw)


class MQTTLink:
    """The one connection of an identity; see the module docstring."""

    def __init__(self, config: LinkConfig):
        self.config = config
        c = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=config.client_id, clean_session=False,
                        protocol=mqtt.MQTTv311)
        c.suppress_exceptions = True  # a callback's bug is logged; paho's loop and the PUBACK go on
        c.max_inflight_messages_set(config.max_inflight)
        # paho's backoff has no jitter: each client starts its doubling at a random point in [min, 2*min),
        # so a fleet that lost the broker together does not come back in lockstep
        first_s = config.reconnect_min_s * random.uniform(1.0, 2.0)
        c.reconnect_delay_set(min_delay=first_s, max_delay=max(first_s, config.reconnect_max_s))
        if config.username:
            c.username_pw_set(config.username, config.password or None)
        if config.tls:
            c.tls_set(ca_certs=config.ca_file or None, cert_reqs=ssl.CERT_REQUIRED,
                      tls_version=ssl.PROTOCOL_TLS_CLIENT)
        c.on_connect, c.on_connect_fail = self._on_connect, self._on_connect_fail
        c.on_disconnect, c.on_publish, c.on_message = self._on_disconnect, self._on_publish, self._on_message
        self.client = c
        self._peers: list = []
        self._subscriptions: dict[str, tuple[int, Callable]] = {}
        self._resend: list[mqtt.MQTTMessage] = []
        self._lock = threading.Lock()
        self._connected = threading.Event()
        self._stopping = False
        self._failing = False
        self.connects = 0

    # -- set-up ---------------------------------------------------------------------------

    def will_set(self, topic: str, payload: bytes, qos: int = 1, retain: bool = True) -> None:
        self.client.will_set(topic, payload, qos=qos, retain=retain)

    def add(self, peer) -> None:
        """A part that publishes on this link; it may define ``on_connect(session_present)``,
        ``on_dropped(messages) -> set of the mids it keeps itself`` and ``on_publish(mid)``."""
        with self._lock:
            self._peers.append(peer)

    def subscribe(self, topic_filter: str, qos: int, handler: Callable[[mqtt.MQTTMessage], None]) -> None:
        """``handler(message)`` for each message on ``topic_filter``, subscribed at every connect."""
        with self._lock:
            self._subscriptions[topic_filter] = (qos, handler)

        def guarded(client, userdata, message) -> None:
            try:
                handler(message)
            except Exception:  # never into paho: its loop would end, the message never be acknowledged
                log.exception("handling a message on %s failed", message.topic[:200])

        self.client.message_callback_add(topic_filter, guarded)  # paho's own topic trie picks the handler
        if self._connected.is_set():
            self.client.subscribe(topic_filter, qos)

    def start(self) -> None:
        self._stopping = False
        self.client.connect_async(self.config.host, self.config.port, keepalive=self.config.keepalive_s)
        self.client.loop_start()

    def stop(self) -> None:
        self._stopping = True
        stop_loop(self.client)
        self._connected.clear()

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout_s: float) -> bool:
        return self._connected.wait(timeout_s)

    def resubscribe(self, topic_filters: list[str], qos: int = 1) -> None:
        """Subscribe again to filters already handled (the broker sends their retained messages
        again); the handlers stay as ``subscribe`` set them."""
        self.client.subscribe([(f, qos) for f in topic_filters])

    def publish(self, topic: str, payload: bytes, qos: int = 1, retain: bool = False) -> mqtt.MQTTMessageInfo:
        if retain:
            with self._lock:  # a newer retained message supersedes one kept from a lost connection
                self._resend = [r for r in self._resend if not (r.retain and r.topic == topic)]
        return self.client.publish(topic, payload, qos=qos, retain=retain)

    # -- paho's network thread --------------------------------------------------------------

    def _on_connect(self, client, userdata, flags, reason_code, properties) -> None:
        if reason_code.is_failure:
            log.error("MQTT broker %s:%d refused %s: %s", self.config.host, self.config.port, self.config.client_id,
                      reason_code)
            return
        self.connects += 1
        self._failing = False
        with self._lock:
            subscriptions = [(f, qos) for f, (qos, _) in self._subscriptions.items()]
            resend, self._resend = self._resend, []
            peers = list(self._peers)
        if subscriptions:
            client.subscribe(subscriptions)
        for m in resend:  # what no peer keeps a copy of: out again, in order
            client.publish(m.topic, m.payload, qos=m.qos, retain=m.retain)
        self._connected.set()
        log.info("MQTT connected to %s:%d as %s (session present: %s)", self.config.host, self.config.port,
                 self.config.client_id, flags.session_present)
        for peer in peers:
            self._call(peer, "on_connect", flags.session_present)

    def _on_connect_fail(self, client, userdata) -> None:
        level = logging.DEBUG if self._failing else logging.WARNING
        self._failing = True
        log.log(level, "MQTT broker %s:%d unreachable; retrying", self.config.host, self.config.port)

    def _on_disconnect(self, client, userdata, flags, reason_code, properties) -> None:
        self._connected.clear()
        dropped = client.drop_out_messages()
        with self._lock:
            peers = list(self._peers)
        kept: set[int] = set()
        for peer in peers:
            kept |= self._call(peer, "on_dropped", dropped) or set()
        with self._lock:
            for m in dropped:
                if m.mid in kept:
                    continue
                if m.retain:  # only the latest of a retained topic matters
                    self._resend = [r for r in self._resend if r.topic != m.topic]
                self._resend.append(m)
            del self._resend[:-MAX_RESEND]
        log.log(logging.INFO if self._stopping else logging.WARNING,
                "MQTT connection to %s:%d %s (%s); %d unacknowledged messages will be sent again",
                self.config.host, self.config.port, "closed" if self._stopping else "lost", reason_code, len(dropped))

    def _on_publish(self, client, userdata, mid, reason_code, properties) -> None:
        with self._lock:
            peers = list(self._peers)
        for peer in peers:
            self._call(peer, "on_publish", mid)

    def _on_message(self, client, userdata, message) -> None:
        """A message no subscription's handler took (another filter of the same session): dropped."""

    @staticmethod
    def _call(peer, name: str, *args):
        method = getattr(peer, name, None)
        if method is None:
            return None
        try:
            return method(*args)
        except Exception:
            log.exception("%s.%s failed", type(peer).__name__, name)
            return None


def stop_loop(client: mqtt.Client) -> None:
    """Disconnect ``client`` and wait for its network thread.

    The DISCONNECT wakes the loop (``loop_stop`` alone waits out a 1 s select). paho 2.x's thread, so ended,
    clears ``_thread`` between ``loop_stop``'s None check and its ``join()``: an AttributeError there means the
    thread has already left its loop, and there is nothing left to wait for."""
    client.disconnect()
    try:
        client.loop_stop()
    except AttributeError:
        pass
