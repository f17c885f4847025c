"""Time-sortable ids: UUIDv7 (RFC 9562), monotonic within a process.

The first 48 bits are the Unix time in milliseconds; the next 12 a counter that orders ids made
in the same millisecond (RFC 9562 method 1, reseeded each millisecond); the rest random. So ids
sort in creation order, and one doubles as the ``Idempotency-Key`` of the request it names.
"""

from __future__ import annotations

import os
import threading
import time
import uuid

_lock = threading.Lock()
_last_ms = 0
_counter = 0


def uuid7(now_ms: int | None = None) -> uuid.UUID:
    global _last_ms, _counter
    with _lock:
        ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
        if ms > _last_ms:
            _last_ms, _counter = ms, int.from_bytes(os.urandom(2)) & 0x1FF  # leave room to count up
        else:  # same millisecond (or the clock stepped back): keep counting from the last id
            _counter += 1
            if _counter > 0xFFF:  # 4096 ids in one millisecond: borrow the next one
                _last_ms, _counter = _last_ms + 1, 0
        ms, counter = _last_ms, _counter
    rand = int.from_bytes(os.urandom(8)) & ((1 << 62) - 1)
    value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | rand
    return uuid.UUID(int=value)


def new_id() -> str:
    return str(uuid7())


def timestamp_ms(u: str | uuid.UUID) -> int:
    """The creation time (Unix ms) a UUIDv7 carries."""
    return (u if isinstance(u, uuid.UUID) else uuid.UUID(u)).int >> 80
