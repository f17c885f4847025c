"""A hostile device, for the fleet's tests: what it sends (Hypothesis strategies over the report,
telemetry and event schemas, and the messages issue 36 reproduced) and a device that sends it
over a real broker with its own enrolled credentials, beside honest simulated devices.

The strategies draw payloads that are *almost* right (the schemas' own field names, with values of
every JSON type, out-of-range numbers, NaN and infinities, integers past 64 bits, strings with
line separators and lone surrogates, nesting) as well as raw bytes cut or corrupted from a valid
message, so they reach past the JSON decoder into the schemas and the store."""

from __future__ import annotations

import json
import threading
import time

from hypothesis import strategies as st

from model_distribution.device.state_client import DeviceStateClient
from model_distribution.protocol.topics import topic

REPORT_FIELDS = ("state", "desired", "rev", "at", "model", "sha256", "reason", "retry", "done", "total", "window",
                 "wait_s", "prefetch", "prefetch_state", "device")
TELEMETRY_FIELDS = ("id", "ts", "uptime_s", "requests", "decisions", "rejected", "latency", "decode", "tokens",
                    "queue", "model", "agent", "kind", "device", "fleet")
EVENT_FIELDS = ("event", "reason", "device", "at")
NASTY_TEXT = ["\u2028", "\u2029", "\u0085", "\x00", "\x1b[2J", "\ud800", "\udfff", "A" * 5000, "ACTIVE", "FAILED",
              "chat/500", "+Inf", "NaN", "tiny@1.0.0"]

leaf = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0, -1, 2**63, 2**64, 10**20, 1e308, 1e-308, 0.5]),
    st.text(max_size=40), st.sampled_from(NASTY_TEXT))
value = st.recursive(leaf, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
    st.text(max_size=12) | st.sampled_from(NASTY_TEXT), inner, max_size=4), max_leaves=12)
counters = st.dictionaries(st.sampled_from(["chat/200", "chat/500", "completions/503", "cloud/hard", "edge/ok",
                                            "+Inf", "0.1", "x" * 80]) | st.text(max_size=8), value, max_size=6)


def _object(fields: tuple[str, ...], special: dict) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={f: special.get(f, value) for f in fields})


reports = _object(REPORT_FIELDS, {"rev": leaf, "at": leaf, "done": leaf, "total": leaf})
telemetry = _object(TELEMETRY_FIELDS, {"requests": counters, "decisions": counters, "ts": leaf, "uptime_s": leaf,
                                       "latency": st.fixed_dictionaries({}, optional={"ttft": st.fixed_dictionaries(
                                           {}, optional={"buckets": counters, "count": leaf})})})
events = _object(EVENT_FIELDS, {})
SCHEMAS = {"reported": reports, "telemetry": telemetry, "events": events}


def encoded(obj) -> bytes:
    """As a device would put it on the wire: JSON that may hold NaN and Infinity tokens."""
    return json.dumps(obj, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def payloads(draw) -> tuple[str, bytes]:
    """(topic kind, payload bytes): a drawn object, or one cut, or corrupted, or not JSON at all."""
    kind = draw(st.sampled_from(["reported", "telemetry", "events", "status"]))
    if kind == "status":
        return kind, draw(st.sampled_from([b"online", b"offline", b"", b"online\n", b"\xff", b"x" * 100]))
    body = encoded(draw(SCHEMAS[kind]))
    how = draw(st.sampled_from(["whole", "whole", "cut", "flip", "bytes"]))
    if how == "cut" and body:
        body = body[:draw(st.integers(0, len(body) - 1))]
    elif how == "flip" and body:
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] + bytes([draw(st.integers(0, 255))]) + body[i + 1:]
    elif how == "bytes":
        body = draw(st.binary(max_size=200))
    return kind, body


REPRODUCED = [  # what issue 36's hostile device sent
    ("telemetry", b'{"id":"t1","ts":1' + b"0" * 400 + b"}"),
    ("telemetry", b'{"id":"t2","ts":1e999}'),
    ("reported", b'{"state":"ACTIVE","at":100000000000000000000}'),
    ("reported", b'{"state":NaN}'),
    ("reported", b'{"state":["ACTIVE"]}'),
    ("events", b'{"event":"desired_refused","reason":"x\\u2028y"}'),
    ("status", b"hacked"),
]


class SimDevice:
    """An honest device: takes what it is told (no download), reports ACTIVE, and sends telemetry
    every ``every_s``: ``per_tick`` requests, of which ``error_rate[sha256]`` fail with 500."""

    def __init__(self, url: str, name: str, secret: str, public_key: bytes, error_rate: dict[str, float],
                 per_tick: int = 10, every_s: float = 0.3):
        self.name, self.error_rate, self.per_tick, self.every_s = name, error_rate, per_tick, every_s
        self.sha256: str | None = None
        self.counts = {"ok": 0, "bad": 0}
        self.started = time.time()
        self.records = 0
        self._stop = threading.Event()
        self.client = DeviceStateClient(url, "default", name, public_key, self.apply, password=secret)
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def start(self) -> SimDevice:
        self.client.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.client.stop()

    def apply(self, payload: dict) -> None:
        self.sha256 = payload["sha256"]
        self.state = {"desired": f"{payload['model']}@{payload['version']}", "rev": payload["rev"], "state": "ACTIVE",
                      "model": f"{payload['model']}@{payload['version']}", "sha256": payload["sha256"]}
        self.client.report(self.state)

    def _serve(self) -> None:
        while not self._stop.wait(self.every_s):
            bad = round(self.per_tick * self.error_rate.get(self.sha256, 0.0))
            self.counts["bad"] += bad
            self.counts["ok"] += self.per_tick - bad
            self.records += 1
            now = time.time()
            self.send_telemetry({"id": f"{self.name}-{self.records}", "ts": now, "uptime_s": now - self.started,
                                 "requests": {"chat/200": self.counts["ok"], "chat/500": self.counts["bad"]},
                                 "decisions": {"edge/confident": self.counts["ok"] + self.counts["bad"]}})

    def send_telemetry(self, record: dict) -> None:
        self.client.link.publish(topic("default", self.name, "telemetry"), json.dumps(record).encode(), qos=1)


class HostileDevice(SimDevice):
    """Enrolled, with its own credentials, and it takes its assignments like any device (so it is
    in the rollout), but it lies: its telemetry claims a flood of perfect requests on whatever it
    runs, and ``send(kind, payload)`` puts anything on its own topics."""

    def _serve(self) -> None:
        while not self._stop.wait(self.every_s):
            self.records += 1
            now = time.time()
            self.counts["ok"] += 10**6
            self.send_telemetry({"id": f"{self.name}-{self.records}", "ts": now + 86400 * 365, "uptime_s": 1e9,
                                 "requests": {"chat/200": self.counts["ok"]},
                                 "decisions": {"edge/confident": self.counts["ok"]}})

    def send(self, kind: str, payload: bytes) -> None:
        self.client.link.publish(topic("default", self.name, kind), payload, qos=1, retain=kind == "reported")

    def say_state(self) -> None:
        """Its true state again, after a round of lies on its own reported topic (its own say is its
        own to spoil; the harness is about what it does to the others)."""
        if getattr(self, "state", None):
            self.client.report(self.state)
