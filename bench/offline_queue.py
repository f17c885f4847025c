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
import asyncio
import json
import logging
import os
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import httpx  # noqa: E402
import numpy as np  # noqa: E402

from edge_agent.config import UpstreamConfig  # noqa: E402
from edge_agent.upstream import Upstream  # noqa: E402
from sync.delivery import DeliveryConfig, DeliveryLoop  # noqa: E402
from sync.group_commit import GroupCommit  # noqa: E402
from sync.ids import new_id  # noqa: E402
from sync.queue import Kind, NewItem, OfflineQueue  # noqa: E402

MODEL = "smollm2-135m"
GOAL = 2000  # durable enqueues/s, batched, synchronous=FULL
DELIVERY_BATCHES = (1, 16)
UNBOUNDED = {"max_items": 10**9, "max_bytes": 1 << 40}  # the rows below must never hit QueueFull


def chat_body(i: int) -> dict:
    """A realistic escalated chat request (~400 bytes of JSON); ``i`` makes the prompt distinct."""
    return {"model": MODEL, "messages": [
        {"role": "system", "content": "You are the maintenance assistant of a pumping station. Answer in one short "
                                      "sentence and name the part to check first."},
        {"role": "user", "content": f"Ticket {i}: pump P-{i % 97} at station {i % 13} reports "
                                    f"{180 + i % 50} kPa outlet pressure and a rising bearing temperature "
                                    f"of {60 + i % 30} C since the last shift. What should the operator do?"}],
        "max_tokens": 1, "temperature": 0, "user": f"device-{i % 8}"}


def new_item(i: int, payload: dict | None = None, item_id: str | None = None) -> NewItem:
    extra = {"id": item_id} if item_id else {}
    return NewItem(Kind.REQUEST, payload or chat_body(i), endpoint="chat", reason="offline", **extra)


# -- enqueue: the stores -----------------------------------------------------------------


class CountingQueue(OfflineQueue):
    """The real queue, counting its transactions (GroupCommit's batch size is items / commits)."""

    commits = 0

    def enqueue_many(self, items):
        self.commits += 1
        return super().enqueue_many(items)

    def rows(self) -> int:
        with self._lock:
            return self._db.conn.execute("SELECT count(*) FROM outbox").fetchone()[0]


class PlainOutbox:
    """The floor of any SQLite outbox: one WAL table, an INSERT per item, one commit per call."""

    def __init__(self, path: Path, synchronous: str):
        self.conn = sqlite3.connect(str(path), isolation_level=None)
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute(f"PRAGMA synchronous={synchronous}")
        self.conn.execute("CREATE TABLE outbox (seq INTEGER PRIMARY KEY, id TEXT NOT NULL, payload TEXT NOT NULL)")
        self.commits = 0

    def put_many(self, payloads: list[dict]) -> None:
        rows = [(new_id(), json.dumps(p, separators=(",", ":"))) for p in payloads]
        self.conn.execute("BEGIN IMMEDIATE")
        self.conn.executemany("INSERT INTO outbox (id, payload) VALUES (?, ?)", rows)
        self.conn.execute("COMMIT")
        self.commits += 1

    def rows(self) -> int:
        return self.conn.execute("SELECT count(*) FROM outbox").fetchone()[0]


@dataclass
class EnqueueRow:
    store: str
    sync: str
    mode: str
    items: int
    elapsed_s: float
    latencies_s: list[float]  # per call: per item (single, group) or per batch (batched)
    commits: int
    rows_at_end: int

    @property
    def rate(self) -> float:
        return self.items / self.elapsed_s


def timed_calls(call: Callable[[int], int], seconds: float) -> tuple[int, float, list[float]]:
    """Call ``call(i)`` (returns items stored) until ``seconds`` have passed."""
    items, lat = 0, []
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        items += call(items)
        lat.append(time.perf_counter() - now)
    return items, time.perf_counter() - start, lat


def payloads(n: int = 256) -> list[dict]:
    return [chat_body(i) for i in range(n)]


def bench_queue(path: Path, sync: str, mode: str, args, bodies: list[dict]) -> EnqueueRow:
    q = CountingQueue(path, synchronous=sync, **UNBOUNDED)
    def single(i: int) -> int:
        q.enqueue(Kind.REQUEST, bodies[i % len(bodies)], endpoint="chat", reason="offline")
        return 1

    def batched(i: int) -> int:
        return len(q.enqueue_many([new_item(0, bodies[(i + k) % len(bodies)]) for k in range(args.batch)]))

    try:
        if mode in ("single", "batched"):
            items, elapsed, lat = timed_calls(single if mode == "single" else batched, args.seconds)
        else:
            items, elapsed, lat = asyncio.run(group_commit(q, bodies, args.concurrency, args.seconds))
        return EnqueueRow("OfflineQueue", sync, mode, items, elapsed, lat, q.commits, q.rows())
    finally:
        q.close()


async def group_commit(q: OfflineQueue, bodies: list[dict], callers: int, seconds: float):
    """``callers`` coroutines, each awaiting GroupCommit.put() in a loop (the agent under load)."""
    gc, lat = GroupCommit(q), []
    start = time.perf_counter()

    async def caller(c: int) -> int:
        n = 0
        while (now := time.perf_counter()) - start < seconds:
            await gc.put(new_item(0, bodies[(c + n * callers) % len(bodies)]))
            lat.append(time.perf_counter() - now)
            n += 1
        return n

    items = sum(await asyncio.gather(*(caller(c) for c in range(callers))))
    return items, time.perf_counter() - start, lat


def bench_plain(path: Path, sync: str, mode: str, args, bodies: list[dict]) -> EnqueueRow:
    box = PlainOutbox(path, sync)
    n = 1 if mode == "single" else args.batch

    def call(i: int) -> int:
        box.put_many([bodies[(i + k) % len(bodies)] for k in range(n)])
        return n

    items, elapsed, lat = timed_calls(call, args.seconds)
    row = EnqueueRow("sqlite3 floor", sync, mode, items, elapsed, lat, box.commits, box.rows())
    box.conn.close()
    return row


def bench_persist_queue(folder: Path, sync: str, args, bodies: list[dict]) -> EnqueueRow:
    """persist-queue's SQLiteAckQueue (WAL; it commits every put: it has no batched put)."""
    import persistqueue
    from persistqueue.serializers import json as pq_json

    q = persistqueue.SQLiteAckQueue(str(folder), serializer=pq_json, auto_resume=False)
    q._putter.execute(f"PRAGMA synchronous={sync}")  # it exposes no setting; the same durability as ours

    def put(i: int) -> int:
        q.put(bodies[i % len(bodies)])
        return 1

    items, elapsed, lat = timed_calls(put, args.seconds)
    row = EnqueueRow("persist-queue", sync, "single", items, elapsed, lat, items, q.size)
    q.close()
    return row


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


@dataclass
class DepthRow:
    rows: int
    single_s: list[float]  # per enqueue()
    batch_s: list[float]  # per enqueue_many() of --batch items
    batch: int

    @property
    def batched_rate(self) -> float:
        return self.batch * len(self.batch_s) / sum(self.batch_s)


def depth_cost(folder: Path, depths: tuple[int, ...], batch: int, calls: int = 100) -> list[DepthRow]:
    """FULL enqueues (single and batched) with ``depth`` rows already in the outbox: the size-bound
    check must not grow with it (the pending counts are kept by triggers, not counted)."""
    out = []
    q = CountingQueue(folder / "depth.db", **UNBOUNDED)
    try:
        have = 0
        for depth in depths:
            while have < depth:
                k = min(2000, depth - have)
                q.enqueue_many([new_item(have + j) for j in range(k)])
                have += k
            single, batched = [], []
            for i in range(calls):
                start = time.perf_counter()
                q.enqueue(Kind.REQUEST, chat_body(i), endpoint="chat")
                single.append(time.perf_counter() - start)
            for _ in range(calls // 5):
                start = time.perf_counter()
                q.enqueue_many([new_item(k) for k in range(batch)])
                batched.append(time.perf_counter() - start)
            have += calls + calls // 5 * batch
            out.append(DepthRow(depth, single, batched, batch))
        return out
    finally:
        q.close()


def print_depth(rows: list[DepthRow]) -> None:
    print("\nEnqueue cost vs rows already in the outbox (FULL)")
    print(f"{'rows':>8s} {'single p50 ms':>14s} {'single p99 ms':>14s} {'batch p50 ms':>13s} {'batched items/s':>16s}")
    for r in rows:
        s50, s99 = pct_ms(r.single_s)
        b50, _ = pct_ms(r.batch_s)
        print(f"{r.rows:8,d} {s50:14.2f} {s99:14.2f} {b50:13.2f} {r.batched_rate:16,.0f}")


def pct_ms(lat: list[float]) -> tuple[float, float]:
    a = np.asarray(lat) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def run_enqueue(args, work: Path) -> tuple[list[EnqueueRow], list[str]]:
    """The rows, and a line for each peer that could not run."""
    bodies = payloads()
    rows, skipped = [], []
    for i, (sync, store, mode) in enumerate(
            (s, st, m) for s in ("FULL", "NORMAL")
            for st, modes in (("queue", ("single", "batched", "group")), ("plain", ("single", "batched")),
                              ("persist", ("single",)))
            for m in modes):
        folder = work / f"enqueue-{i}"
        folder.mkdir()
        if store == "queue":
            rows.append(bench_queue(folder / "queue.db", sync, mode, args, bodies))
        elif store == "plain":
            rows.append(bench_plain(folder / "plain.db", sync, mode, args, bodies))
        else:
            try:
                rows.append(bench_persist_queue(folder, sync, args, bodies))
            except ImportError:
                skipped.append(f"persist-queue {sync}: skipped, not installed (.venv/bin/pip install persist-queue)")
                continue
        r = rows[-1]
        print(f"  {r.store} {r.sync} {r.mode}: {r.rate:,.0f} items/s", file=sys.stderr)
    return rows, skipped


def print_enqueue(rows: list[EnqueueRow], skipped: list[str], args, work: Path) -> None:
    body_bytes = len(json.dumps(chat_body(0), separators=(",", ":")))
    print(f"\nDurable enqueue, {args.seconds:g} s per row on a fresh db in {work}, {body_bytes}-byte chat body, "
          f"{os.cpu_count()} cores; batch = {args.batch}, group = {args.concurrency} concurrent callers")
    print(f"{'store':14s} {'sync':6s} {'mode':8s} {'items/s':>9s} {'per call':>9s} {'p50 ms':>8s} {'p99 ms':>8s} "
          f"{'items/commit':>12s} {'rows at end':>11s}")
    for r in rows:
        p50, p99 = pct_ms(r.latencies_s)
        unit = "batch" if r.mode == "batched" else "item"
        print(f"{r.store:14s} {r.sync:6s} {r.mode:8s} {r.rate:9,.0f} {unit:>9s} {p50:8.3f} {p99:8.3f} "
              f"{r.items / max(1, r.commits):12.1f} {r.rows_at_end:11,d}")
    for line in skipped:
        print(line)
    by = {(r.store, r.sync, r.mode): r for r in rows}
    for mode in ("batched", "group"):
        r = by[("OfflineQueue", "FULL", mode)]
        floor = by.get(("sqlite3 floor", "FULL", mode))
        vs = f" ({r.rate / floor.rate:.0%} of the sqlite3 floor)" if floor else ""
        print(f"{mode} FULL: {r.rate:,.0f} enqueues/s vs goal {GOAL:,}: {'met' if r.rate >= GOAL else 'NOT met'}{vs}")


# -- delivery ----------------------------------------------------------------------------


@dataclass
class DeliveryRow:
    path: str
    kind: str  # fresh | replay
    concurrency: int
    items: int
    elapsed_s: float
    latencies_s: list[float]  # per HTTP request
    ok: int
    retried: int = 0
    failed: int = 0

    @property
    def rate(self) -> float:
        return self.items / self.elapsed_s


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_gateway(work: Path, env: dict, cli: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(work / "gateway.log", "wb")
    proc = subprocess.Popen([*cli, "cloud", "serve", "--both", "1", "--prefill", "0", "--decode", "0",
                             "--model", MODEL, "--max-model-len", "1024", "--kv-cache-bytes", str(64 << 20),
                             "--port", str(port)], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/healthz", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"the gateway did not come up; see {work / 'gateway.log'}")
        time.sleep(0.5)


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def drain(path: Path, items: list[NewItem], url: str, key: str, batch: int, kind: str) -> DeliveryRow:
    """Enqueue ``items`` (FULL), then run a DeliveryLoop until each is delivered or refused."""
    queue = OfflineQueue(path)
    queue.enqueue_many(items)
    upstream = Upstream(UpstreamConfig(url=url, api_key=key, model=MODEL))
    lat = []

    async def send(item):
        start = time.perf_counter()
        out = await upstream.deliver(item)
        lat.append(time.perf_counter() - start)
        return out

    loop = DeliveryLoop(queue, send, upstream.probe, upstream.breaker, DeliveryConfig(batch_size=batch))
    start = time.perf_counter()
    task = asyncio.create_task(loop.run())
    try:
        # drained = every outcome committed: the counters move just before complete_many() runs
        while loop.delivered + loop.failed < len(items) or queue.stats()["pending_items"]:
            if task.done() or time.perf_counter() - start > 600:
                raise RuntimeError(f"delivery stalled: {loop.delivered} delivered, {loop.retried} retried")
            await asyncio.sleep(0.001)
        elapsed = time.perf_counter() - start
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await upstream.close()
    done = queue.stats()["by_kind"]["request"]["done"]
    queue.close()
    return DeliveryRow(f"DeliveryLoop batch {batch}", kind, batch, len(items), elapsed, lat, done,
                       loop.retried, loop.failed)


async def bare(items: list[NewItem], url: str, key: str, concurrency: int, kind: str) -> DeliveryRow:
    """The floor: the same requests (same body, same Idempotency-Key) from a bare httpx client,
    ``concurrency`` in flight, no queue, nothing durable."""
    headers = {"authorization": f"Bearer {key}", "accept": "application/json"}
    lat, statuses = [], []
    todo = iter(items)
    async with httpx.AsyncClient(headers=headers, timeout=120,
                                 limits=httpx.Limits(max_connections=64, max_keepalive_connections=16)) as client:
        async def worker():
            for it in todo:
                t0 = time.perf_counter()
                r = await client.post(f"{url}/v1/chat/completions", json=it.payload,
                                      headers={"idempotency-key": it.id})
                lat.append(time.perf_counter() - t0)
                statuses.append(r.status_code)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    return DeliveryRow(f"bare httpx x{concurrency}", kind, concurrency, len(items), elapsed, lat,
                       sum(200 <= s < 300 for s in statuses), failed=sum(s >= 300 for s in statuses))


async def delivery_rows(url: str, key: str, n: int, work: Path) -> list[DeliveryRow]:
    fresh = [new_item(10_000 + i) for i in range(n)]
    fresh_peer = [new_item(20_000 + i) for i in range(n)]
    # warm the engine (first-request compilation and allocation) on a prompt used nowhere else
    await bare([new_item(30_000)], url, key, 1, "warm-up")
    rows = [await drain(work / "fresh.db", fresh, url, key, DELIVERY_BATCHES[-1], "fresh"),
            await bare(fresh_peer, url, key, DELIVERY_BATCHES[-1], "fresh")]
    for b in DELIVERY_BATCHES:  # the same ids and bodies again: the gateway answers from its idempotency store
        replay = [new_item(0, it.payload, it.id) for it in fresh]
        rows.append(await drain(work / f"replay-{b}.db", replay, url, key, b, "replay"))
    for c in DELIVERY_BATCHES:
        rows.append(await bare(fresh, url, key, c, "replay"))
    return rows


def run_delivery(args, work: Path) -> list[DeliveryRow]:
    env = {**os.environ, "CASCADE_CLOUD_GATEWAY_DB": str(work / "gateway.db"), "OMP_WAIT_POLICY": "passive"}
    cli = [sys.executable, "-m", "cascade.cli", "--log-level", "WARNING"]
    key = subprocess.run([*cli, "cloud", "keys", "create", "--db", str(work / "gateway.db"), "--tenant", "bench"],
                         env=env, cwd=REPO, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
    started = time.perf_counter()
    proc, url = start_gateway(work, env, cli)
    print(f"  gateway up in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    try:
        return asyncio.run(delivery_rows(url, key, args.deliver, work))
    finally:
        stop(proc)


def print_delivery(rows: list[DeliveryRow], args, work: Path) -> None:
    print(f"\nDelivery to a local gateway (`cloud serve --both 1`, {MODEL}), {args.deliver} chat requests "
          "(max_tokens 1, temperature 0), queue at synchronous=FULL")
    print(f"{'requests':8s} {'path':22s} {'items/s':>9s} {'drain s':>8s} {'req p50 ms':>11s} {'req p99 ms':>11s} "
          f"{'2xx':>5s} {'retried':>8s} {'failed':>7s}")
    for r in rows:
        p50, p99 = pct_ms(r.latencies_s)
        print(f"{r.kind:8s} {r.path:22s} {r.rate:9.1f} {r.elapsed_s:8.2f} {p50:11.2f} {p99:11.2f} "
              f"{r.ok:5d} {r.retried:8d} {r.failed:7d}")
    by = {(r.kind, r.path): r for r in rows}
    b1, bn = by[("replay", "DeliveryLoop batch 1")], by[("replay", f"DeliveryLoop batch {DELIVERY_BATCHES[-1]}")]
    floor = by[("replay", f"bare httpx x{DELIVERY_BATCHES[-1]}")]
    print(f"replays: batch {DELIVERY_BATCHES[-1]} delivers {bn.rate / b1.rate:.1f}x batch 1; "
          f"{bn.rate / floor.rate:.0%} of the bare httpx floor at the same concurrency")
    log = (work / "gateway.log").read_text(errors="replace").splitlines()
    errors = [line for line in log if "ERROR" in line or "Traceback" in line]
    warnings = [line for line in log if "WARNING" in line]
    print(f"gateway log: {len(errors)} error line(s), {len(warnings)} warning line(s) ({work / 'gateway.log'})")
    for line in (errors or warnings)[:5]:
        print(f"  {line[:160]}")


# -- main --------------------------------------------------------------------------------


def plot(path: str, enqueue: list[EnqueueRow], delivery: list[DeliveryRow]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [("durable enqueues/s", [f"{r.store}\n{r.sync} {r.mode}" for r in enqueue], [r.rate for r in enqueue])]
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
    p.add_argument("--dir", default=None, help="where the temporary databases go (default: the system's)")
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
