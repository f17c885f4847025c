"""Device credentials on the control plane's device endpoints: HTTP Basic parsing, and verified
pairs remembered for a while (scrypt per request is too slow for a fleet), wrong ones never."""

from __future__ import annotations

import base64

import pytest

from model_distribution.control_plane.credentials import DeviceCredentials, basic_credentials
from model_distribution.fleet.devices import DeviceStore


def basic(text: str) -> str:
    return "Basic " + base64.b64encode(text.encode()).decode()


@pytest.mark.parametrize("header, pair", [
    (basic("kiosk-7:s3cret"), ("kiosk-7", "s3cret")),
    (basic("kiosk-7:a:b"), ("kiosk-7", "a:b")),  # the secret is everything after the first colon
    (basic("kiosk-7:"), None), (basic(":s3cret"), None), (basic("kiosk-7"), None),
    ("Bearer abc", None), ("Basic not-base64!", None), ("", None),
    ("Basic " + base64.b64encode(b"\xff:\xfe").decode(), None),
])
def test_basic_credentials_are_parsed_or_refused(header, pair):
    assert basic_credentials(header) == pair


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_verified_pair_is_remembered_for_its_ttl_and_a_wrong_one_never(tmp_path):
    store = DeviceStore(tmp_path)
    secret = store.add("kiosk-7", [])
    clock = Clock()
    creds = DeviceCredentials(store, ttl_s=60, clock=clock)
    assert not creds.cached("kiosk-7", secret)
    assert creds.verify("kiosk-7", secret) and creds.cached("kiosk-7", secret)
    assert not creds.verify("kiosk-7", "guess") and not creds.cached("kiosk-7", "guess")
    assert not creds.verify("kiosk-8", secret)
    clock.now += 61
    assert not creds.cached("kiosk-7", secret)  # checked against the store again after the ttl
    assert creds.verify("kiosk-7", secret)
    store.close()


def test_the_remembered_pairs_are_bounded(tmp_path):
    store = DeviceStore(tmp_path)
    secrets_ = {d: store.add(d, []) for d in ("a", "b", "c")}
    clock = Clock()
    creds = DeviceCredentials(store, ttl_s=60, clock=clock, max_pairs=2)
    for d, s in secrets_.items():
        assert creds.verify(d, s)
    assert creds.cached("c", secrets_["c"]) and not creds.cached("a", secrets_["a"])  # full: started over
    store.close()


def test_wrong_guesses_are_throttled_per_device_and_address_for_the_window(tmp_path):
    store = DeviceStore(tmp_path)
    store.add("kiosk-7", [])
    clock = Clock()
    creds = DeviceCredentials(store, clock=clock, max_failures=3, failure_window_s=60)
    for _ in range(3):
        assert creds.throttled("kiosk-7", "10.0.0.9") == 0
        creds.failed("kiosk-7", "10.0.0.9")
    assert creds.throttled("kiosk-7", "10.0.0.9") == pytest.approx(60)  # no scrypt for this address now
    assert creds.throttled("kiosk-7", "10.0.0.10") == 0 and creds.throttled("kiosk-8", "10.0.0.9") == 0
    clock.now += 61
    assert creds.throttled("kiosk-7", "10.0.0.9") == 0
    creds.failed("kiosk-7", "10.0.0.9")  # a new window starts counting from one
    assert creds.throttled("kiosk-7", "10.0.0.9") == 0
    store.close()
