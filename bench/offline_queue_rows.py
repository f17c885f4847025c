"""The measurements of bench/offline_queue.py (its command line and tables): durable enqueues
into the offline queue and its peers, enqueue cost against outbox depth, and delivery to a local
gateway through the DeliveryLoop and a bare httpx loop. Each function returns rows; nothing here
prints a table."""

from __future__ import annotations

import asyncio
import json
import os
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from cascade.processes import NotHealthy, free_port, spawn, stop, wait_healthy
from cascade_cli.spawn import cascade_command
from edge_agent.config import UpstreamConfig
from edge_agent.upstream import Upstream
from sync.delivery import DeliveryConfig, DeliveryLoop
from sync.group_commit import GroupCommit
from sync.ids import new_id
from sync.queue import Kind, NewItem, OfflineQueue

REPO = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"
DELIVERY_BATCHES = (1, 16)
UNBOUNDED = {"max_items": 10**9, "max_bytes": 1 << 40}  # the rows below must never hit QueueFull


def chat_body(i: int) -> dict:
    """A realistic escalated chat request (~400 bytes of JSON); ``i`` makes the prompt distinct."""
    return {"model": MODEL, "messages": [
        {"role": "system", "content": "You are the maintenance assistant of a pumping station. "
                                      "Answer in one short sentence and name the part to check "
                                      "first."},
        {"role": "user", "content": f"Ticket {i}: pump P-{i % 97} at station {i % 13} reports "
                                    f"{180 + i % 50} kPa outlet pressure and a rising bearing "
                                    f"temperature of {60 + i % 30} C since the last shift. What "
                                    "should the operator do?"}],
        "max_tokens": 1, "temperature": 0, "user": f"device-{i % 8}"}


def new_item(i: int, payload: dict | None = None, item_id: str | None = None) -> NewItem:
    extra = {"id": item_id} if item_id else {}
    return NewItem(Kind.REQUEST, payload or chat_body(i), endpoint="chat", reason="offline",
                   **extra)


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
        self.conn.execute("CREATE TABLE outbox (seq INTEGER PRIMARY KEY, id TEXT NOT NULL, "
                          "payload TEXT NOT NULL)")
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


def bench_queue(path: Path, sync: str, mode: str, args, bodies: list[dict]) -> EnqueueRow:
    q = CountingQueue(path, synchronous=sync, **UNBOUNDED)

    def single(i: int) -> int:
        q.enqueue(Kind.REQUEST, bodies[i % len(bodies)], endpoint="chat", reason="offline")
        return 1

    def batched(i: int) -> int:
        return len(q.enqueue_many([new_item(0, bodies[(i + k) % len(bodies)])
                                   for k in range(args.batch)]))

    try:
        if mode == "group":
            run = group_commit(q, bodies, args.concurrency, args.seconds)
            items, elapsed, lat = asyncio.run(run)
        else:
            items, elapsed, lat = timed_calls({"single": single, "batched": batched}[mode],
                                              args.seconds)
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
    # it exposes no setting; the same durability as ours
    q._putter.execute(f"PRAGMA synchronous={sync}")

    def put(i: int) -> int:
        q.put(bodies[i % len(bodies)])
        return 1

    items, elapsed, lat = timed_calls(put, args.seconds)
    row = EnqueueRow("persist-queue", sync, "single", items, elapsed, lat, items, q.size)
    q.close()
    return row


@dataclass
class DepthRow:
    rows: int
    single_s: list[float]  # per enqueue()
    batch_s: list[float]  # per enqueue_many() of --batch items
    batch: int

    @property
    def batched_rate(self) -> float:
        return self.batch * len(self.batch_s) / sum(self.batch_s)


def depth_cost(folder: Path, depths: tuple[int, ...], batch: int,
               calls: int = 100) -> list[DepthRow]:
    """FULL enqueues (single and batched) with ``depth`` rows already in the outbox: the
    size-bound check must not grow with it (the pending counts are kept by triggers, not
    counted)."""
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


def run_enqueue(args, work: Path) -> tuple[list[EnqueueRow], list[str]]:
    """The rows, and a line for each peer that could not run."""
    bodies = [chat_body(i) for i in range(256)]
    rows, skipped = [], []
    stores = (("queue", ("single", "batched", "group")), ("plain", ("single", "batched")),
              ("persist", ("single",)))
    for i, (sync, store, mode) in enumerate(
            (s, st, m) for s in ("FULL", "NORMAL") for st, modes in stores for m in modes):
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
                skipped.append(f"persist-queue {sync}: skipped, not installed "
                               "(.venv/bin/pip install persist-queue)")
                continue
        r = rows[-1]
        print(f"  {r.store} {r.sync} {r.mode}: {r.rate:,.0f} items/s", file=sys.stderr)
    return rows, skipped


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


def start_gateway(work: Path, env: dict) -> tuple[subprocess.Popen, str]:
    """`cascade cloud serve --both 1` on a free port, its log in ``work``: once healthy."""
    port = free_port()
    log = work / "gateway.log"
    proc = spawn(cascade_command("cloud", "serve", "--both", "1", "--prefill", "0",
                                 "--decode", "0", "--model", MODEL, "--max-model-len", "1024",
                                 "--kv-cache-bytes", str(64 << 20), "--port", str(port)),
                 env=env, log=log, cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout_s=600, what=f"gateway (log {log})", log=log)
    except NotHealthy:
        stop(proc, timeout_s=30)
        raise
    return proc, url


async def drain(path: Path, items: list[NewItem], url: str, key: str, batch: int,
                kind: str) -> DeliveryRow:
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

    loop = DeliveryLoop(queue, send, upstream.probe, upstream.breaker,
                        DeliveryConfig(batch_size=batch))
    start = time.perf_counter()
    task = asyncio.create_task(loop.run())
    try:
        # drained = every outcome committed: the counters move just before complete_many() runs
        while loop.delivered + loop.failed < len(items) or queue.stats()["pending_items"]:
            if task.done() or time.perf_counter() - start > 600:
                raise RuntimeError(f"delivery stalled: {loop.delivered} delivered, "
                                   f"{loop.retried} retried")
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


async def bare(items: list[NewItem], url: str, key: str, concurrency: int,
               kind: str) -> DeliveryRow:
    """The floor: the same requests (same body, same Idempotency-Key) from a bare httpx client,
    ``concurrency`` in flight, no queue, nothing durable."""
    headers = {"authorization": f"Bearer {key}", "accept": "application/json"}
    lat, statuses = [], []
    todo = iter(items)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=16)
    async with httpx.AsyncClient(headers=headers, timeout=120, limits=limits) as client:
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
                       sum(200 <= s < 300 for s in statuses),
                       failed=sum(s >= 300 for s in statuses))


async def delivery_rows(url: str, key: str, n: int, work: Path) -> list[DeliveryRow]:
    fresh = [new_item(10_000 + i) for i in range(n)]
    fresh_peer = [new_item(20_000 + i) for i in range(n)]
    # warm the engine (first-request compilation and allocation) on a prompt used nowhere else
    await bare([new_item(30_000)], url, key, 1, "warm-up")
    rows = [await drain(work / "fresh.db", fresh, url, key, DELIVERY_BATCHES[-1], "fresh"),
            await bare(fresh_peer, url, key, DELIVERY_BATCHES[-1], "fresh")]
    # the same ids and bodies again: the gateway answers from its idempotency store
    for b in DELIVERY_BATCHES:
        replay = [new_item(0, it.payload, it.id) for it in fresh]
        rows.append(await drain(work / f"replay-{b}.db", replay, url, key, b, "replay"))
    for c in DELIVERY_BATCHES:
        rows.append(await bare(fresh, url, key, c, "replay"))
    return rows


def run_delivery(args, work: Path) -> list[DeliveryRow]:
    env = {"CASCADE_CLOUD_GATEWAY_DB": str(work / "gateway.db")}
    out = subprocess.run(cascade_command("cloud", "keys", "create",
                                         "--db", str(work / "gateway.db"), "--tenant", "bench"),
                         env={**os.environ, "OMP_WAIT_POLICY": "passive", **env}, cwd=REPO,
                         capture_output=True, text=True, check=True).stdout
    key = out.strip().splitlines()[-1]
    started = time.perf_counter()
    proc, url = start_gateway(work, env)
    print(f"  gateway up in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    try:
        return asyncio.run(delivery_rows(url, key, args.deliver, work))
    finally:
        stop(proc, timeout_s=30)
