"""The gateway's view of its workers: role, health and load from ``/internal/load`` (polled),
plus what the gateway itself has put on each (prompt tokens waiting to prefill, KV blocks
committed to requests in flight), which the polled numbers lag behind."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import httpx

from cloud_tier.disagg.protocol import WorkerLoadReport
from cloud_tier.gateway.placement import WorkerLoad

log = logging.getLogger(__name__)


@dataclass
class Worker:
    url: str
    role: str = "unknown"
    healthy: bool = False
    report: WorkerLoadReport | None = None
    pending_prefill_tokens: int = 0
    committed_blocks: int = 0
    in_flight: int = 0
    down_since: float | None = None
    last_error: str = ""

    @property
    def kv_address(self) -> str | None:
        return self.report.kv_address if self.report else None

    def load(self) -> WorkerLoad:
        r = self.report
        total = r.kv_blocks_total if r else 0
        in_use = (r.kv_blocks_total - r.kv_blocks_free) if r else 0
        # the worker's own count lags our commitments; its count also holds what others put there
        used = max(in_use, self.committed_blocks)
        queue = (r.waiting if r else 0) + self.in_flight
        return WorkerLoad(self.url, self.pending_prefill_tokens, total, used, queue, self.healthy)


class WorkerPool:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, api_key: str = "",
                 interval_s: float = 0.5):
        self.workers = {u.rstrip("/"): Worker(u.rstrip("/")) for u in urls}
        self.client = client
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()  # set when capacity may have grown

    async def start(self, wait_s: float = 0.0) -> None:
        """Poll every worker once (for up to ``wait_s`` until all answer), then keep polling."""
        deadline = time.monotonic() + wait_s
        while True:
            await self.poll()
            if all(w.healthy for w in self.workers.values()) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def by_role(self, *roles: str, healthy: bool = True) -> list[Worker]:
        return [w for w in self.workers.values() if w.role in roles and (w.healthy or not healthy)]

    @property
    def block_size(self) -> int:
        for w in self.workers.values():
            if w.report:
                return w.report.block_size
        return 16

    @property
    def max_model_len(self) -> int | None:
        lens = [w.report.max_model_len for w in self.workers.values() if w.report]
        return min(lens) if lens else None

    def mark_down(self, url: str, error: str) -> None:
        w = self.workers.get(url)
        if w is not None and w.healthy:
            log.warning("worker %s is down: %s", url, error)
            w.healthy = False
            w.down_since = time.monotonic()
            w.last_error = error

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(w) for w in self.workers.values()))

    async def _poll_one(self, w: Worker) -> None:
        try:
            r = await self.client.get(f"{w.url}/internal/load", headers=self.headers, timeout=2.0)
            r.raise_for_status()
            report = WorkerLoadReport.model_validate_json(r.content)
        except (httpx.HTTPError, ValueError) as e:
            self.mark_down(w.url, repr(e))
            return
        if not w.healthy:
            log.info("worker %s (%s) is up", w.url, report.role)
        w.report, w.role, w.healthy, w.down_since = report, report.role, True, None
        self.changed.set()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.poll()
            except Exception:  # never let the health loop die
                log.exception("worker poll failed")
