"""TelemetryPublisher against a real Mosquitto (persistent, so a subscriber's session and its
queued QoS 1 messages survive a broker restart), and against a broker that never sends PUBACK."""

from __future__ import annotations

import getpass
import json
import logging
import shutil
import signal
import socket
import subprocess
import threading
import time
from collections import Counter
from pathlib import Path

import paho.mqtt.client as mqtt
import pytest

from cascade.processes import free_port
from sync.mqtt import MQTTConfig, TelemetryPublisher, encode_telemetry, telemetry_topic
from sync.mqtt_link import stop_loop
from sync.queue import Kind, NewItem, OfflineQueue

MOSQUITTO = shutil.which("mosquitto") or shutil.which("mosquitto", path="/usr/sbin")
FLEET, DEVICE = "fleet-a", "dev-1"
TOPIC = telemetry_topic(FLEET, DEVICE)
log = logging.getLogger(__name__)


def wait_until(predicate, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


class Mosquitto:
    """A mosquitto process on a loopback port; SIGTERM makes it save its sessions to disk."""

    def __init__(self, home: Path):
        home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.log = home / "mosquitto.log"
        self.conf = home / "mosquitto.conf"
        # run as root, mosquitto drops to user "mosquitto", who cannot write into pytest's tmp dir
        self.conf.write_text(f"listener {self.port} 127.0.0.1\nallow_anonymous true\npersistence true\n"
                             f"persistence_location {home}/\nuser {getpass.getuser()}\n")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.conf)], stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mosquitto exited ({self.proc.returncode}):\n{self.log.read_text()}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


class Subscriber:
    """A persistent-session QoS 1 subscriber (subscribing again at each connect) collecting payloads."""

    def __init__(self, port: int):
        self._lock = threading.Lock()
        self._received: list[tuple[str, dict]] = []
        self.subscribed = threading.Event()
        self.client = mqtt.Client(mqtt.CallbackAPIVersion.VERSION2, client_id=f"test-subscriber-{port}",
                                  clean_session=False, protocol=mqtt.MQTTv311)
        self.client.reconnect_delay_set(min_delay=0.1, max_delay=0.5)
        self.client.on_connect = lambda client, *_: client.subscribe(TOPIC, qos=1)
        self.client.on_subscribe = lambda *_: self.subscribed.set()
        self.client.on_message = self._on_message
        self.client.connect_async("127.0.0.1", port, keepalive=10)
        self.client.loop_start()

    def _on_message(self, client, userdata, message) -> None:
        with self._lock:
            self._received.append((message.topic, json.loads(message.payload)))

    @property
    def received(self) -> list[tuple[str, dict]]:
        with self._lock:
            return list(self._received)

    def ids(self) -> set[str]:
        return {body["id"] for _, body in self.received}

    def close(self) -> None:
        stop_loop(self.client)


class SilentBroker:
    """Accepts MQTT connections and PUBLISH packets, and never acknowledges one (no PUBACK)."""

    def __init__(self):
        self._server = socket.create_server(("127.0.0.1", 0))
        self._server.settimeout(0.1)
        self.port = self._server.getsockname()[1]
        self.published: list[dict] = []
        self._conns: list[socket.socket] = []
        self._closed = False
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)
            self._conns.append(conn)
            threading.Thread(target=self._session, args=(conn,), daemon=True).start()

    def _session(self, conn: socket.socket) -> None:
        try:
            with conn.makefile("rb") as f:
                while header := f.read(1):
                    length, shift = 0, 0
                    while (byte := f.read(1)[0]) & 0x80:
                        length, shift = length | (byte & 0x7F) << shift, shift + 7
                    body = f.read(length | byte << shift)
                    kind, qos = header[0] >> 4, (header[0] >> 1) & 3
                    if kind == 1:  # CONNECT: accept it
                        conn.sendall(b"\x20\x02\x00\x00")
                    elif kind == 3:  # PUBLISH: keep its payload, acknowledge nothing
                        start = 2 + int.from_bytes(body[:2], "big") + (2 if qos else 0)
                        self.published.append(json.loads(body[start:]))
                    elif kind == 12:  # PINGREQ
                        conn.sendall(b"\xd0\x00")
        except (OSError, IndexError):  # the client went away
            pass

    def drop_connections(self) -> None:
        for conn in self._conns:
            conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._conns.clear()

    def close(self) -> None:
        self._closed = True
        self._server.close()
        self.drop_connections()


class WatchedPublisher(TelemetryPublisher):
    """A TelemetryPublisher whose publish rounds a test can wait for: after ``look_again()`` the
    publisher has looked at the queue (and its connection and in-flight bound) since the call."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._rounds = threading.Condition()
        self._started = self._finished = 0  # publish rounds begun / the last one ended, numbered

    def _publish_round(self) -> bool:
        with self._rounds:
            self._started += 1
            n = self._started
        try:
            return super()._publish_round()
        finally:
            with self._rounds:
                self._finished = n
                self._rounds.notify_all()

    def look_again(self, timeout_s: float = 10.0) -> None:
        """Wake the publisher and wait until a round that began after this call has ended."""
        with self._rounds:
            target = self._started + 1
        self.notify()
        with self._rounds:
            if not self._rounds.wait_for(lambda: self._finished >= target, timeout_s):
                raise AssertionError(f"no publish round within {timeout_s} s")


@pytest.fixture
def broker(tmp_path):
    if MOSQUITTO is None:
        pytest.skip("mosquitto is not installed (apt-get install mosquitto): these tests need a real MQTT broker")
    b = Mosquitto(tmp_path / "broker")
    b.start()
    yield b
    b.stop()


@pytest.fixture
def subscriber(broker):
    s = Subscriber(broker.port)
    assert s.subscribed.wait(10), "the subscriber did not subscribe"
    yield s
    s.close()


@pytest.fixture
def silent_broker():
    b = SilentBroker()
    yield b
    b.close()


@pytest.fixture
def queue(tmp_path):
    q = OfflineQueue(tmp_path / "outbox.db")
    yield q
    q.close()


@pytest.fixture
def start_publisher(queue):
    started = []

    def start(port: int, **kw) -> WatchedPublisher:
        config = MQTTConfig(port=port, fleet=FLEET, device=DEVICE, reconnect_min_s=0.1, reconnect_max_s=0.5, **kw)
        publisher = WatchedPublisher(queue, config)
        publisher.start()
        started.append(publisher)
        return publisher

    yield start
    for publisher in started:
        publisher.stop(timeout_s=1)


def spool(queue: OfflineQueue, start: int, n: int) -> dict[str, dict]:
    """Enqueue telemetry ``start .. start+n-1``: id -> payload."""
    payloads = [{"n": i, "temp_c": 40 + i / 10, "tags": {"slot": i % 3}} for i in range(start, start + n)]
    ids = queue.enqueue_many(NewItem(Kind.TELEMETRY, p) for p in payloads)
    return dict(zip(ids, payloads, strict=True))


def pending(queue: OfflineQueue) -> int:
    return queue.stats()["pending_items"]


def test_the_queue_id_is_in_the_message_and_a_payload_field_cannot_shadow_it(queue):
    (item_id,) = queue.enqueue_many([NewItem(Kind.TELEMETRY, {"id": "spoofed", "n": 1})])
    (item,) = queue.claim(Kind.TELEMETRY, 1)
    assert json.loads(encode_telemetry(item)) == {"id": item_id, "n": 1}
    assert encode_telemetry(item) == f'{{"id":"{item_id}","n":1}}'.encode()


def test_spooled_telemetry_is_published_as_spooled_and_deleted_once_acked(broker, subscriber, queue,
                                                                            start_publisher):
    sent = spool(queue, 0, 10)
    publisher = start_publisher(broker.port, poll_s=30)  # a long poll: only notify() can be quick
    wait_until(lambda: len(subscriber.received) == 10, "the first 10 messages")
    wait_until(lambda: pending(queue) == 0 and publisher.stats()["acked"] == 10, "the first 10 acks")
    publisher.look_again()  # it has seen the empty queue: idle now, in its 30 s wait
    sent |= (later := spool(queue, 10, 5))
    publisher.notify()
    wait_until(lambda: subscriber.ids() >= set(later), "the 5 notified messages", timeout_s=5)
    wait_until(lambda: pending(queue) == 0, "the queue to empty")

    received = subscriber.received
    assert [topic for topic, _ in received] == [TOPIC] * 15
    assert sorted((body["id"], body) for _, body in received) == sorted((i, {"id": i, **p}) for i, p in sent.items())
    assert publisher.stats() == {"connected": True, "published": 15, "acked": 15, "released": 0, "reconnects": 0,
                                 "in_flight": 0}


def test_telemetry_spooled_while_the_broker_is_down_arrives_when_it_starts(broker, subscriber, queue,
                                                                           start_publisher):
    broker.stop()  # the subscriber's session (and its subscription) is saved
    publisher = start_publisher(broker.port)
    sent = spool(queue, 0, 30)
    publisher.look_again()  # it has looked at the 30 spooled items since
    assert not publisher.connected
    assert pending(queue) == 30 and publisher.stats()["published"] == 0  # nothing claimed while disconnected

    broker.start()
    wait_until(lambda: subscriber.ids() == set(sent), "all 30 messages after the broker started")
    wait_until(lambda: pending(queue) == 0, "the queue to empty")
    assert publisher.connected


def test_a_broker_restart_mid_stream_loses_no_spooled_item(broker, subscriber, queue, start_publisher):
    publisher = start_publisher(broker.port)
    sent: dict[str, dict] = {}

    def spool_stream():  # 200 items over ~2 s, before, during and after the restart
        for i in range(200):
            sent.update(spool(queue, i, 1))
            publisher.notify()
            time.sleep(0.01)

    spooler = threading.Thread(target=spool_stream)
    spooler.start()
    wait_until(lambda: len(subscriber.received) >= 40, "the stream to start")
    broker.stop()
    spooled_before = len(sent)
    wait_until(lambda: not publisher.connected and len(sent) >= min(spooled_before + 100, 200),
               "the publisher to lose the broker while 100 more items are spooled")
    broker.start()
    spooler.join()
    wait_until(lambda: subscriber.ids() == set(sent), "every spooled item after the restart", timeout_s=20)
    wait_until(lambda: pending(queue) == 0, "the queue to empty")

    counts = Counter(body["id"] for _, body in subscriber.received)
    duplicates = sum(n - 1 for n in counts.values())
    log.info("broker restart: %d duplicates, publisher stats %s", duplicates, publisher.stats())
    assert publisher.stats()["reconnects"] >= 1
    # at most what the publisher had in flight, plus what the broker had in flight to the subscriber (20)
    assert duplicates <= publisher.config.max_inflight + 20


def test_an_item_stays_in_the_queue_until_its_puback_even_across_a_lost_connection(silent_broker, queue,
                                                                                   start_publisher):
    sent = spool(queue, 0, 8)
    first_five = list(sent)[:5]
    publisher = start_publisher(silent_broker.port, max_inflight=5)
    wait_until(lambda: len(silent_broker.published) == 5, "5 publishes")
    publisher.look_again()  # a round with 3 items queued: it would send more, were the in-flight bound not kept
    assert [body["id"] for body in silent_broker.published] == first_five
    assert publisher.stats()["in_flight"] == 5 and publisher.stats()["acked"] == 0
    assert queue.stats()["by_kind"]["telemetry"] == {"queued": 3, "sending": 5, "done": 0, "failed": 0, "expired": 0}

    silent_broker.drop_connections()  # the unacked five go back to the queue and out again after the reconnect
    wait_until(lambda: len(silent_broker.published) == 10, "5 publishes after the reconnect")
    publisher.look_again()
    assert [body["id"] for body in silent_broker.published[5:]] == first_five
    assert publisher.stats() == {"connected": True, "published": 10, "acked": 0, "released": 5,
                                 "reconnects": 1, "in_flight": 5}
    assert pending(queue) == 8

    publisher.stop(timeout_s=0.5)
    assert queue.stats()["by_kind"]["telemetry"]["queued"] == 8 and publisher.stats()["released"] == 10


def test_items_left_by_a_stopped_or_a_dead_publisher_are_sent_by_the_next(silent_broker, broker, subscriber,
                                                                          queue, start_publisher):
    sent = spool(queue, 0, 6)
    first = start_publisher(silent_broker.port)
    wait_until(lambda: len(silent_broker.published) == 6, "6 unacknowledged publishes")
    first.stop(timeout_s=0.5)
    assert pending(queue) == 6
    queue.claim(Kind.TELEMETRY, 2)  # as a process that died while sending would leave them
    assert queue.recover() == 2  # what the agent does at start-up

    second = start_publisher(broker.port)
    wait_until(lambda: subscriber.ids() == set(sent), "the 6 items from the next publisher")
    wait_until(lambda: pending(queue) == 0, "the queue to empty")
    assert second.stats()["acked"] == 6


def test_telemetry_and_the_fleets_topics_are_one_scheme():
    from model_distribution.protocol.topics import topic

    assert telemetry_topic(FLEET, DEVICE) == topic(FLEET, DEVICE, "telemetry") == \
        f"cascade/v1/{FLEET}/devices/{DEVICE}/telemetry"
