"""Resource accounting after a test: every server a test left running must be back to holding
nothing once its requests are over. Servers started through ``tests.conftest.Server`` register
here; ``leaks()`` polls each live one (a grace period: releases are asynchronous) and names what
is still held:

  edge agent   /healthz: no slot busy, nobody waiting for one
  gateway      /metrics: nothing waiting for admission, no KV committed on any worker; and its
               workers (from /healthz) as below
  worker       /internal/stats: nothing running or waiting, no held prefill, every KV block free,
               no prefill, adoption or KV transfer in flight (tests/integration/worker_accounting.py)
  machine      no /dev/shm KV segment left since the test began
"""

from __future__ import annotations

import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests import loopback
from tests.integration.worker_accounting import leftovers, shm_segments

LIVE: list = []  # tests.conftest.Server instances whose process runs


def _get(url: str) -> httpx.Response | None:
    try:
        return loopback.get(url, timeout=5)  # not httpx.get: a TLS context per call, several per test
    except httpx.HTTPError:
        return None


def _agent(server) -> list[str]:
    r = _get(f"{server.url}/healthz")
    if r is None or r.status_code != 200:
        return []
    slots = r.json().get("slots", {})
    return [f"{k} {slots[k]}" for k in ("busy", "waiting") if slots.get(k)]


def _worker(url: str) -> list[str]:
    r = _get(f"{url}/internal/stats")
    if r is None or r.status_code != 200:  # not one of ours (a fake or foreign worker), or gone
        return []
    return leftovers(r.json())


def _gateway(server) -> list[str]:
    left = []
    r = _get(f"{server.url}/metrics")
    if r is not None and r.status_code == 200:
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                if s.name == "cascade_gateway_admission_waiting" and s.value:
                    left.append(f"{s.value:.0f} waiting for admission")
                if s.name == "cascade_gateway_worker_committed_blocks" and s.value:
                    left.append(f"{s.value:.0f} KV blocks committed on {s.labels.get('worker')}")
    h = _get(f"{server.url}/healthz")
    if h is not None and h.status_code == 200:
        for url in h.json().get("workers", {}):
            left += [f"worker {url}: {x}" for x in _worker(url)]
    return left


CHECKS = {"agent": _agent, "gateway": _gateway, "worker": lambda s: _worker(s.url), "fleet": lambda s: []}


def leaks(shm_before: set[str], timeout_s: float = 10.0) -> dict[str, list[str]]:
    """What the live servers (and /dev/shm) still hold after ``timeout_s``; {} when all settled."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = {}
        for server in list(LIVE):
            if server.proc.poll() is not None:  # a test stopped or killed it: nothing to check
                continue
            if found := CHECKS[server.kind](server):
                left[f"{server.what} ({server.url})"] = found
        segments = shm_segments() - shm_before
        if segments:
            left["/dev/shm"] = sorted(segments)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
