"""What a device tells the control plane, typed and bounded: its reported state, its telemetry
records and its events, over MQTT and over HTTP alike, through one codec (``decode``).

A device's say is outside data: ``decode`` takes the payload's bytes through the one strict
decoder (cascade/wire.py: NaN, infinities, numbers beyond a float, integers beyond 64 bits,
control characters and line separators refused) and then through these schemas (wrong types,
strings and maps over their bounds refused; keys no schema knows are dropped). What it returns
is what the control plane stores, so everything downstream reads numbers it can trust:
``RefusedMessage`` (with a ``reason`` to count it by) otherwise.

Counters are bounded by what a device could have done: no counter may exceed
``(uptime_s + CLOCK_SKEW_S) * MAX_DEVICE_RATE`` (an edge device answers a few requests a second;
this allows a thousand), so one device cannot claim a fleet's worth of traffic.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError

from cascade import wire

MAX_REPORT_BYTES = 16 << 10
MAX_TELEMETRY_BYTES = 32 << 10
MAX_EVENT_BYTES = 4 << 10
MAX_DEVICE_RATE = 1000.0  # requests (decisions, tokens / 100) a second that a device could have answered
MAX_COUNT = float(2**53)  # beyond this a float counter stops counting by ones
CLOCK_SKEW_S = 300.0  # how far a device's clock may run ahead of the control plane's before it is pulled back
MAX_TIME = 1e11  # seconds since the epoch (the year 5138): past this a device's time is no time
KINDS = ("reported", "telemetry", "events", "status")
STATUSES = ("online", "offline")


class DeviceState(StrEnum):
    """The steps a device reports of a version change (device/client.py says them; a report's
    ``state`` may hold another token, from a newer agent, which no rollout reads as final)."""

    DOWNLOADING = "DOWNLOADING"  # resumable, into staging (done/total reported)
    VERIFYING = "VERIFYING"  # the signed TUF target (length, sha256)
    WAITING = "WAITING"  # verified; its activation window is not open yet (wait_s)
    ACTIVATING = "ACTIVATING"  # the agent switches to it
    ACTIVE = "ACTIVE"  # it serves the version (final)
    FAILED = "FAILED"  # final, unless ``retry`` says it tries again; the old model still serves
    REJECTED = "REJECTED"  # refused up front, with the reason (final)


class RefusedMessage(ValueError):
    """A device's message refused; ``reason`` is a short code (wire's, or "schema", "implausible",
    "status") to count it by."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _bucket_bound(key: str) -> str:
    if key != "+Inf":
        try:
            value = float(key)
        except ValueError:
            raise ValueError(f"histogram bucket {key!r} is not a number or +Inf") from None
        if not math.isfinite(value):
            raise ValueError(f"histogram bucket {key!r} is not finite")
    return key


Text = Annotated[str, Field(max_length=200)]
Name = Annotated[str, Field(min_length=1, max_length=64)]
Count = Annotated[float, Field(ge=0, le=MAX_COUNT)]
Seconds = Annotated[float, Field(ge=0, le=MAX_TIME)]
Counts = Annotated[dict[Name, Count], Field(max_length=128)]
Buckets = Annotated[dict[Annotated[Name, AfterValidator(_bucket_bound)], Count], Field(max_length=64)]


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore", allow_inf_nan=False, frozen=True)


class ReportedState(_Message):
    """What a device says it runs and how its change goes (device/client.py writes it)."""

    state: Annotated[str, Field(pattern=r"^[A-Z_]{1,32}$")] | None = None
    desired: Text | None = None  # name@version this report is about
    rev: Annotated[int, Field(ge=0, le=wire.INT64_MAX)] | None = None  # the desired revision it is about
    at: Seconds | None = None  # the device's clock when it said it
    model: Text | None = None  # name@version it serves
    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")] | None = None
    reason: Annotated[str, Field(max_length=1000)] | None = None
    retry: bool | None = None
    done: Annotated[int, Field(ge=0, le=2**62)] | None = None
    total: Annotated[int, Field(ge=0, le=2**62)] | None = None
    window: Text | None = None
    wait_s: Seconds | None = None  # WAITING: seconds until its activation window opens
    prefetch: Text | None = None
    prefetch_state: Annotated[str, Field(pattern=r"^[A-Z_]{1,32}$")] | None = None
    device: Name | None = None


class Histogram(_Message):
    count: Count = 0
    mean_s: Seconds | None = None
    buckets: Buckets = {}


class Latency(_Message):
    ttft: Histogram | None = None
    e2e: Histogram | None = None


class Decode(_Message):
    tokens: Count = 0
    seconds: Seconds = 0.0


class Tokens(_Message):
    prompt: Count = 0
    generated: Count = 0


class Queue(_Message):
    pending: Count | None = None
    pending_bytes: Count | None = None
    oldest_pending_age_s: Seconds | None = None
    telemetry_dropped: Count | None = None
    requests: Counts | None = None  # queued requests by state


class ModelInfo(_Message):
    name: Text | None = None
    quantization: Text | None = None
    architecture: Text | None = None
    n_ctx: Annotated[int, Field(ge=0, le=2**40)] | None = None


class AgentInfo(_Message):
    version: Text | None = None
    python: Text | None = None


class TelemetryRecord(_Message):
    """One of the agent's telemetry records (edge_agent/server/telemetry.py): counters cumulative
    since its agent started, so a consumer takes differences."""

    id: Name | Annotated[int, Field(ge=0, le=wire.INT64_MAX)]
    ts: Seconds  # the device's clock (the store pulls a clock far ahead back, see DeviceStore.telemetry)
    uptime_s: Seconds  # since its agent started: what bounds its counters (a record without it is refused)
    requests: Counts = {}
    decisions: Counts = {}
    rejected: Counts = {}
    latency: Latency = Latency()
    decode: Decode = Decode()
    tokens: Tokens = Tokens()
    queue: Queue | None = None
    model: ModelInfo | None = None
    agent: AgentInfo | None = None
    kind: Text | None = None
    device: Name | None = None
    fleet: Name | None = None

    def implausible(self) -> str | None:
        """Why these counters are more than the device could have done, or None."""
        most = (self.uptime_s + CLOCK_SKEW_S) * MAX_DEVICE_RATE
        for name in ("requests", "decisions", "rejected"):
            total = sum(getattr(self, name).values())
            if total > most:
                return f"{name} {total:.0f} in {self.uptime_s:.0f} s of uptime: more than {MAX_DEVICE_RATE:.0f}/s"
        if self.decode.tokens > 100 * most:
            return f"decode tokens {self.decode.tokens:.0f} in {self.uptime_s:.0f} s of uptime"
        return None


class Event(_Message):
    """Something a device wants the operator to know (say, a desired document it refused)."""

    event: Name
    reason: Annotated[str, Field(max_length=1000)] | None = None
    device: Name | None = None
    at: Seconds | None = None


LIMITS = {"reported": MAX_REPORT_BYTES, "telemetry": MAX_TELEMETRY_BYTES, "events": MAX_EVENT_BYTES,
          "status": 16}
SCHEMAS: dict[str, type[_Message]] = {"reported": ReportedState, "telemetry": TelemetryRecord, "events": Event}


def decode(kind: Literal["reported", "telemetry", "events", "status"], payload: bytes
           ) -> ReportedState | TelemetryRecord | Event | str:
    """A device's message of ``kind`` (a topic's last segment) as its typed value (a status is
    "online" or "offline"); RefusedMessage otherwise."""
    if kind not in LIMITS:
        raise RefusedMessage("topic", f"no such device topic {kind!r}")
    if kind == "status":
        status = bytes(payload).decode("ascii", "replace")
        if status not in STATUSES:
            raise RefusedMessage("status", f"a status is online or offline, not {status[:20]!r}")
        return status
    try:
        data = wire.loads(payload, limit=LIMITS[kind], max_depth=8, text_safe=True)
    except wire.WireError as e:
        raise RefusedMessage(e.reason, str(e)) from None
    return validate(kind, data)


def validate(kind: str, data) -> ReportedState | TelemetryRecord | Event:
    """``data`` (decoded already: a dict from a test, or stored) as the schema of ``kind``."""
    if not isinstance(data, dict):
        raise RefusedMessage("schema", f"a {kind} message is a JSON object")
    try:
        value = SCHEMAS[kind].model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or kind
        raise RefusedMessage("schema", f"{where}: {first['msg']}") from None
    if isinstance(value, TelemetryRecord):
        why = value.implausible()
        if why:
            raise RefusedMessage("implausible", why)
    return value


def reported_state(kept: dict | None) -> ReportedState | None:
    """A reported state as the DeviceStore keeps it (validated when it came in), typed again for
    the code that acts on it; None for none, or for one this schema no longer takes."""
    if not isinstance(kept, dict):
        return None
    try:
        return ReportedState.model_validate(kept)
    except ValidationError:
        return None


def encode(value: _Message | str) -> bytes:
    """A decoded message as ``decode`` takes it again."""
    if isinstance(value, str):
        return value.encode()
    import json

    return json.dumps(stored(value)).encode()


def stored(value: _Message) -> dict:
    """What is kept of a message: its fields as JSON-safe plain values, unset ones left out."""
    return value.model_dump(exclude_none=True)
