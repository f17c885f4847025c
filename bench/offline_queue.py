"""Offline queue: durable enqueues/s (synchronous FULL and NORMAL; one item per transaction,
batched, and group commit under concurrent callers) against a plain sqlite3 outbox and
persist-queue, then the DeliveryLoop's drain rate to a local gateway against a bare httpx loop,
same run.

    .venv/bin/python bench/offline_queue.py [--seconds 3] [--batch 64] [--concurrency 32]
        [--deliver 64] [--skip-delivery] [--dir DIR] [--plot PATH]

Each enqueue row runs for --seconds on a fresh database in a temporary folder (--dir: put it on
the disk the edge queue lives on; on tmpfs an fsync costs nothing). The payload is a chat
request body of about 400 bytes. A second table times enqueues into an outbox that already
holds 10k and 100k rows. Delivery starts `cascade cloud serve --both 1` on a free port
with a temporary key database (the model is converted once under $CASCADE_HOME) and keeps its
log in the temporary folder. Goal (the issue): >= 2,000 durable enqueues/s batched.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# run as `.venv/bin/python bench/offline_queue.py`: sys.path[0] is bench/, so its sibling module
# imports by its bare name
from offline_queue_rows import (
    DELIVERY_BATCHES,
    MODEL,
    DeliveryRow,
    DepthRow,
    EnqueueRow,
    chat_body,
    depth_cost,
    run_delivery,
    run_enqueue,
)

GOAL = 2000  # durable enqueues/s, batched, synchronous=FULL


def fsync_latency(folder: Path, n: int = 200) -> list[float]:
    """A 4 KiB append and fsync: what one synchronous=FULL commit waits for at least."""
    lat = []
    fd = os.open(folder / "fsync.probe", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        for _ in range(n):
            start = time.perf_counter()
            os.write(fd, b"x" * 4096)
            os.fsync(fd)
            lat.append(time.perf_counter() - start)
    finally:
        os.close(fd)
    return lat


def pct_ms(lat: list[float]) -> tuple[float, float]:
    a = np.asarray(lat) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def print_depth(rows: list[DepthRow]) -> None:
    print("\nEnqueue cost vs rows already in the outbox (FULL)")
    print(f"{'rows':>8s} {'single p50 ms':>14s} {'single p99 ms':>14s} {'batch p50 ms':>13s} "
          f"{'batched items/s':>16s}")
    for r in rows:
        s50, s99 = pct_ms(r.single_s)
        b50, _ = pct_ms(r.batch_s)
        print(f"{r.rows:8,d} {s50:14.2f} {s99:14.2f} {b50:13.2f} {r.batched_rate:16,.0f}")


def print_enqueue(rows: list[EnqueueRow], skipped: list[str], args, work: Path) -> None:
    body_bytes = len(json.dumps(chat_body(0), separators=(",", ":")))
    print(f"\nDurable enqueue, {args.seconds:g} s per row on a fresh db in {work}, "
          f"{body_bytes}-byte chat body, {os.cpu_count()} cores; batch = {args.batch}, "
          f"group = {args.concurrency} concurrent callers")
    print(f"{'store':14s} {'sync':6s} {'mode':8s} {'items/s':>9s} {'per call':>9s} {'p50 ms':>8s} "
          f"{'p99 ms':>8s} {'items/commit':>12s} {'rows at end':>11s}")
    for r in rows:
        p50, p99 = pct_ms(r.latencies_s)
        unit = "batch" if r.mode == "batched" else "item"
        print(f"{r.store:14s} {r.sync:6s} {r.mode:8s} {r.rate:9,.0f} {unit:>9s} {p50:8.3f} "
              f"{p99:8.3f} {r.items / max(1, r.commits):12.1f} {r.rows_at_end:11,d}")
    for line in skipped:
        print(line)
    by = {(r.store, r.sync, r.mode): r for r in rows}
    for mode in ("batched", "group"):
        r = by[("OfflineQueue", "FULL", mode)]
        floor = by.get(("sqlite3 floor", "FULL", mode))
        vs = f" ({r.rate / floor.rate:.0%} of the sqlite3 floor)" if floor else ""
        print(f"{mode} FULL: {r.rate:,.0f} enqueues/s vs goal {GOAL:,}: "
              f"{'met' if r.rate >= GOAL else 'NOT met'}{vs}")


def print_delivery(rows: list[DeliveryRow], args, work: Path) -> None:
    print(f"\nDelivery to a local gateway (`cloud serve --both 1`, {MODEL}), {args.deliver} chat "
          "requests (max_tokens 1, temperature 0), queue at synchronous=FULL")
    print(f"{'requests':8s} {'path':22s} {'items/s':>9s} {'drain s':>8s} {'req p50 ms':>11s} "
          f"{'req p99 ms':>11s} {'2xx':>5s} {'retried':>8s} {'failed':>7s}")
    for r in rows:
        p50, p99 = pct_ms(r.latencies_s)
        print(f"{r.kind:8s} {r.path:22s} {r.rate:9.1f} {r.elapsed_s:8.2f} {p50:11.2f} {p99:11.2f} "
              f"{r.ok:5d} {r.retried:8d} {r.failed:7d}")
    by = {(r.kind, r.path): r for r in rows}
    last = DELIVERY_BATCHES[-1]
    b1, bn = by[("replay", "DeliveryLoop batch 1")], by[("replay", f"DeliveryLoop batch {last}")]
    floor = by[("replay", f"bare httpx x{last}")]
    print(f"replays: batch {last} delivers {bn.rate / b1.rate:.1f}x batch 1; "
          f"{bn.rate / floor.rate:.0%} of the bare httpx floor at the same concurrency")
    log = (work / "gateway.log").read_text(errors="replace").splitlines()
    errors = [line for line in log if "ERROR" in line or "Traceback" in line]
    warnings = [line for line in log if "WARNING" in line]
    print(f"gateway log: {len(errors)} error line(s), {len(warnings)} warning line(s) "
          f"({work / 'gateway.log'})")
    for line in (errors or warnings)[:5]:
        print(f"  {line[:160]}")


def plot(path: str, enqueue: list[EnqueueRow], delivery: list[DeliveryRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("durable enqueues/s", [f"{r.store}\n{r.sync} {r.mode}" for r in enqueue],
               [r.rate for r in enqueue])]
    if delivery:
        panels.append(("delivered requests/s", [f"{r.kind}\n{r.path}" for r in delivery],
                       [r.rate for r in delivery]))
    fig, axes = plt.subplots(len(panels), 1, figsize=(12, 4.5 * len(panels)), squeeze=False)
    for ax, (title, labels, values) in zip(axes[:, 0], panels, strict=True):
        ax.bar(range(len(values)), values)
        ax.set_xticks(range(len(values)), labels, rotation=45, ha="right", fontsize=7)
        ax.set_yscale("log")
        ax.set_title(title)
    axes[0, 0].axhline(GOAL, color="red", linestyle="--", label=f"goal {GOAL:,}/s (batched FULL)")
    axes[0, 0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"\nplot: {path}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=3.0, help="per enqueue row")
    p.add_argument("--batch", type=int, default=64, help="items per enqueue_many()")
    p.add_argument("--concurrency", type=int, default=32, help="GroupCommit callers")
    p.add_argument("--deliver", type=int, default=64, help="requests per delivery row")
    p.add_argument("--skip-delivery", action="store_true", help="enqueue only: no gateway")
    p.add_argument("--dir", default=None,
                   help="where the temporary databases go (default: the system's)")
    p.add_argument("--plot", default=None, help="write a PNG bar chart here")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    work = Path(tempfile.mkdtemp(prefix="queue-bench-", dir=args.dir))
    started = time.perf_counter()

    enqueue, skipped = run_enqueue(args, work)
    delivery = [] if args.skip_delivery else run_delivery(args, work)

    print_enqueue(enqueue, skipped, args, work)
    f50, f99 = pct_ms(fsync_latency(work))
    print(f"fsync of a 4 KiB append in {work}: p50 {f50:.3f} ms, p99 {f99:.3f} ms "
          "(what each FULL commit waits for at least)")
    print_depth(depth_cost(work, (0, 10_000, 100_000), args.batch))
    if delivery:
        print_delivery(delivery, args, work)
    if args.plot:
        plot(args.plot, enqueue, delivery)
    print(f"\ntotal {time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
