"""A device's credentials on the control plane's HTTP device endpoints: HTTP Basic
``device_id:secret`` (the pair ``cascade fleet devices add`` printed), checked against the
DeviceStore's salted hash (HMAC-SHA256 of a 192-bit random secret; scrypt for devices enrolled
before, about 70 ms of CPU each).

A pair verified once is remembered for ``ttl_s`` (as a sha256 of the secret, never the secret
itself); a wrong pair is never remembered. Guesses are bounded twice: at most ``max_failures``
wrong pairs per device and client address in ``failure_window_s`` (then wrong pairs from that
address get 429), and at most ``max_concurrent`` checks at once however many addresses guess.
No one can lock a device out: a device's right secret is taken from a throttled address too
(``check``), because checking it costs a keyed hash; only a store's old scrypt hashes (~70 ms
of CPU each) are not checked at all for a throttled address, which is what keeps them from being
a lever on the CPU. The address is the TCP peer's: X-Forwarded-For counts only from the proxies
``[server] forwarded_allow_ips`` names.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import threading
import time
from collections.abc import Callable

from model_distribution.fleet.devices import DeviceStore


def basic_credentials(authorization: str) -> tuple[str, str] | None:
    """``(device_id, secret)`` from an ``Authorization: Basic ...`` header value; None if it is not one."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        user, sep, secret = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return (user, secret) if sep and user and secret else None


class DeviceCredentials:
    """Verified ``(device_id, secret)`` pairs, remembered for ``ttl_s``. ``cached`` is cheap (call
    it on the event loop); ``verify`` checks the hash (call it on a thread)."""

    def __init__(self, store: DeviceStore, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic,
                 max_pairs: int = 100_000, max_failures: int = 10, failure_window_s: float = 60.0,
                 max_concurrent: int = 2):
        self.store, self.ttl_s, self.clock, self.max_pairs = store, ttl_s, clock, max_pairs
        self.max_failures, self.failure_window_s = max_failures, failure_window_s
        self._until: dict[tuple[str, bytes], float] = {}  # (device, sha256(secret)) -> verified until
        self._failures: dict[tuple[str, str], tuple[int, float]] = {}  # (device, client) -> (count, since)
        self._checks = threading.BoundedSemaphore(max_concurrent)
        self._lock = threading.Lock()

    def throttled(self, device_id: str, client: str) -> float:
        """Seconds until ``client`` may try ``device_id`` again (0: now)."""
        count, since = self._failures.get((device_id, client), (0, 0.0))
        left = since + self.failure_window_s - self.clock()
        return left if count >= self.max_failures and left > 0 else 0.0

    def failed(self, device_id: str, client: str) -> None:
        now = self.clock()
        with self._lock:
            count, since = self._failures.get((device_id, client), (0, now))
            if now - since > self.failure_window_s:
                count, since = 0, now
            if len(self._failures) >= self.max_pairs and (device_id, client) not in self._failures:
                # full: forget what has expired, else the oldest half; never everything at once (100,000
                # guesses for invented names used to lift every throttle, a real device's among them)
                self._failures = {k: v for k, v in self._failures.items() if now - v[1] <= self.failure_window_s}
                if len(self._failures) >= self.max_pairs:
                    keep = sorted(self._failures.items(), key=lambda kv: kv[1][1])[len(self._failures) // 2:]
                    self._failures = dict(keep)
            self._failures[(device_id, client)] = (count + 1, since)

    def cached(self, device_id: str, secret: str) -> bool:
        until = self._until.get((device_id, _digest(secret)))
        return until is not None and until > self.clock()

    def check(self, device_id: str, secret: str, client: str) -> bool | float:
        """The device endpoints' check (call it on a thread): True for the right pair, False for a
        wrong one (counted against ``client``), or the seconds to wait when ``client`` is throttled
        and this pair was not checked (a wrong one, or one whose check would be slow)."""
        wait = self.throttled(device_id, client)
        if wait and self.store.secret_kind(device_id) == "scrypt":
            return wait
        verdict = self.verify(device_id, secret)
        if verdict is None:  # no such device: nothing to guess, nothing to count (no entry for invented names)
            return False
        if verdict:
            return True
        self.failed(device_id, client)
        return wait or False

    def verify(self, device_id: str, secret: str) -> bool | None:
        """Check the pair against the stored hash; remember it when it holds (None: no such device)."""
        if self.cached(device_id, secret):
            return True
        with self._checks:
            verdict = self.store.authenticate(device_id, secret)
            if not verdict:
                return verdict
        now = self.clock()
        with self._lock:
            if len(self._until) >= self.max_pairs:  # bounded: drop what expired, else start over
                self._until = {k: t for k, t in self._until.items() if t > now}
                if len(self._until) >= self.max_pairs:
                    self._until.clear()
            self._until[(device_id, _digest(secret))] = now + self.ttl_s
        return True


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()
