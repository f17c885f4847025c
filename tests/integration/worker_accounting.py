"""What a cloud worker holds once its requests are over: nothing. ``wait_idle`` polls each
worker's ``GET /internal/stats`` until its engine runs and queues nothing, holds no prefilled
request, has every KV block free, and no prefill, adoption or KV transfer is in flight; and
until no shared-memory KV segment made since ``shm_before`` is left."""

from __future__ import annotations

import time
from pathlib import Path

from tests import loopback

SHM = Path("/dev/shm")


def shm_segments() -> set[str]:
    return {p.name for p in SHM.glob("cascade-kv-*")} if SHM.is_dir() else set()


def worker_stats(url: str) -> dict:
    r = loopback.get(f"{url}/internal/stats", timeout=10)
    r.raise_for_status()
    return r.json()


def leftovers(stats: dict) -> list[str]:
    """What ``stats`` (one worker's) shows still held, in words; [] when idle."""
    e = stats["engine"]
    left = [f"{k} {e[k]}" for k in ("running", "waiting", "held") if e[k]]
    if e["kv_blocks_free"] != e["kv_blocks_total"]:
        left.append(f"{e['kv_blocks_total'] - e['kv_blocks_free']} KV blocks in use")
    if (p := stats.get("prefill")) and p["in_flight"]:
        left.append(f"{p['in_flight']} prefills in flight")
    if d := stats.get("decode"):
        left += [f"decode {k} {d[k]}" for k in ("pending", "transfers_expected", "transfers_receiving",
                                                 "receiving_bytes") if d.get(k)]
    return left


def wait_idle(*urls: str, shm_before: set[str] | None = None, timeout_s: float = 15.0) -> dict[str, dict]:
    """Every worker's stats once all are idle; AssertionError naming what is left after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {u: worker_stats(u) for u in urls}
        left = {u: x for u, s in stats.items() if (x := leftovers(s))}
        segments = shm_segments() - shm_before if shm_before is not None else set()
        if not left and not segments:
            return stats
        if time.monotonic() > deadline:
            raise AssertionError(f"after {timeout_s} s: workers still hold {left}, shm segments left {segments}")
        time.sleep(0.05)
