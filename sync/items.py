"""What the offline queue holds: item states and kinds, new and stored items, its errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sync.ids import new_id


class State(StrEnum):
    QUEUED = "queued"
    SENDING = "sending"
    DONE = "done"
    FAILED = "failed"
    EXPIRED = "expired"


PENDING = (State.QUEUED.value, State.SENDING.value)


class Kind(StrEnum):
    REQUEST = "request"  # an escalation: POSTed to the cloud, its response kept in the inbox
    TELEMETRY = "telemetry"  # published over MQTT, deleted once the broker acknowledged it


class KeyReused(ValueError):
    """An app's Idempotency-Key already names a different queued request."""


class QueueFull(Exception):
    """The outbox is at its size bound and holds no telemetry to drop: the request is refused."""

    def __init__(self, message: str, stats: dict):
        super().__init__(message)
        self.stats = stats


@dataclass(frozen=True)
class NewItem:
    kind: Kind
    payload: dict
    endpoint: str = ""  # requests: "chat" | "completions"
    session: str | None = None  # items of one session are delivered in order
    priority: int = 0  # higher first
    ttl_s: float | None = None  # None: the queue's default for the kind
    callback_url: str | None = None
    reason: str = ""  # why it was queued (the escalation reason)
    app_key: str | None = None  # the app's own Idempotency-Key: the same key enqueues once
    id: str = field(default_factory=new_id)


@dataclass
class Item:
    id: str
    seq: int
    kind: str
    state: str
    endpoint: str
    session: str | None
    priority: int
    payload: dict
    bytes: int
    created_at: float
    expires_at: float
    attempts: int
    next_attempt_at: float
    last_error: str
    callback_url: str | None
    reason: str
    updated_at: float
    app_key: str | None = None  # the app's own Idempotency-Key, when it gave one
    failures: int = 0  # attempts that failed for a reason of the request's own (bounded: [sync] max_attempts)
    result_status: int | None = None  # from the inbox, once done or failed
    result: Any = None

    @classmethod
    def from_row(cls, row: dict) -> Item:
        row = dict(row)
        row.pop("lease_until", None)
        row["payload"] = json.loads(row["payload"])
        if row.get("result") is not None:
            row["result"] = json.loads(row["result"])
        return cls(**row)


COLUMN_NAMES = ("seq", "id", "kind", "state", "endpoint", "session", "priority", "payload", "bytes", "created_at",
          "expires_at", "attempts", "next_attempt_at", "last_error", "callback_url", "reason", "updated_at",
          "lease_until", "app_key", "failures")
COLUMNS = ", ".join(COLUMN_NAMES)
O_COLUMNS = ", ".join(f"o.{c}" for c in COLUMN_NAMES)  # the same, in a join with the inbox


def item_of(row, with_result: bool = False) -> Item:
    """An ``Item`` from a row of ``COLUMNS`` (then ``status, result`` from the inbox, when asked)."""
    names = COLUMN_NAMES + (("result_status", "result") if with_result else ())
    return Item.from_row(dict(zip(names, row, strict=True)))
