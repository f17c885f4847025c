"""The gateway's view of its workers: kind, role, health and load, plus what the gateway itself
has put on each (prompt tokens waiting to prefill, KV blocks committed to requests in flight,
requests sent since the last scrape), which the polled numbers lag behind.

Our workers (kind ``cascade``) report on ``/internal/load``; foreign ones (``vllm``, ``sglang``,
any ``openai``-compatible server) on their own ``/metrics``, scraped about every second, and
their health on ``/health`` (``/v1/models`` for a plain OpenAI-compatible one). A worker's kind is
what it was given, else detected: ``/internal/load`` answers -> cascade, else the names in its
``/metrics``. A worker whose numbers are older than ``stale_after_s`` counts as saturated. Every
answer is read bounded and its numbers checked (``workers.load``): a refused one is a failed poll,
counted by reason in ``load_refused``."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from dataclasses import dataclass

import httpx

from cascade.policy.backpressure import CircuitBreaker
from cloud_tier.disagg.protocol import WorkerLoadReport
from cloud_tier.gateway.workers.http_client import Unreachable, WorkerBroke, WorkerHTTP
from cloud_tier.gateway.workers.http_client import get_bounded as http_get
from cloud_tier.gateway.workers.load import MAX_SCRAPE_BYTES, LoadRefused, checked_report, get_bounded
from cloud_tier.gateway.workers.metrics_scrape import KINDS, ForeignLoad, detect_kind, parse_load
from cloud_tier.gateway.workers.placement import WorkerLoad

log = logging.getLogger(__name__)


@dataclass
class Worker:
    url: str
    role: str = "unknown"
    kind: str = "auto"  # cascade | vllm | sglang | openai; auto until detected
    healthy: bool = False
    report: WorkerLoadReport | None = None  # ours
    foreign: ForeignLoad | None = None  # a foreign worker's /metrics
    scraped_at: float | None = None  # monotonic time of the last good poll
    sent_since_scrape: int = 0  # requests the gateway sent after that poll, still in flight
    scrape_epoch: int = 0  # counts the good polls
    poll_failures: int = 0  # polls failed in a row
    blocks_since_scrape: int = 0  # ... and the KV blocks they may need
    pending_prefill_tokens: int = 0
    committed_blocks: int = 0
    batch_blocks: int = 0  # of those, committed to batch-class requests: an online one may take them
    in_flight: int = 0
    down_since: float | None = None
    last_error: str = ""
    breaker: CircuitBreaker | None = None

    @property
    def is_foreign(self) -> bool:
        return self.kind in ("vllm", "sglang", "openai")

    def available(self) -> bool:
        """Healthy and its breaker lets a request through."""
        return self.healthy and (self.breaker is None or self.breaker.available)

    poll_every_s: float = 0.0  # how often the pool polls it now (``WorkerPool.poll_interval``)

    def stale(self, now: float, stale_after_s: float) -> bool:
        """Its numbers are older than ``stale_after_s``, or than three polls where polls are rarer."""
        return self.scraped_at is None or now - self.scraped_at > max(stale_after_s, 3 * self.poll_every_s)

    @property
    def kv_address(self) -> str | None:
        return self.report.kv_address if self.report else None

    def load(self, over_batch: bool = False) -> WorkerLoad:
        """Its load as the router sees it; ``over_batch``: for an online request, which the engine
        serves before batch-class ones (preempting them), so the blocks committed to those count as free."""
        r = self.report
        total = r.kv_blocks_total if r else 0
        in_use = (r.kv_blocks_total - r.kv_blocks_free) if r else 0
        # the worker's own count lags our commitments; its count also holds what others put there
        used = max(in_use, self.committed_blocks)
        if over_batch:
            used = max(0, used - self.batch_blocks)
        queue = (r.waiting if r else 0) + self.in_flight
        return WorkerLoad(self.url, self.pending_prefill_tokens, total, used, queue, self.healthy)


class WorkerPool:
    def __init__(self, urls: list[str], client: httpx.AsyncClient, api_key: str = "",
                 interval_s: float = 0.5, kind: str = "auto", roles: dict[str, str] | None = None,
                 metrics_interval_s: float = 1.0, breaker_threshold: int = 3, breaker_open_s: float = 5.0,
                 http: WorkerHTTP | None = None, max_polls_per_s: float = 20.0):
        if kind != "auto" and kind not in KINDS:
            raise ValueError(f"worker type must be auto or one of {', '.join(KINDS)}, got {kind!r}")
        if not max_polls_per_s > 0:
            raise ValueError(f"max_polls_per_s must be > 0, got {max_polls_per_s!r}")
        self.client = client
        self.http = http  # the polls' client (aiohttp); None: httpx's ``client``
        self.max_polls_per_s = max_polls_per_s
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.interval_s = interval_s
        self.metrics_interval_s = metrics_interval_s
        self.kind = kind
        self._breaker = (breaker_threshold, breaker_open_s)
        self.workers: dict[str, Worker] = {}
        self.set_workers({u: (roles or {}).get(u, "") for u in urls})
        self._task: asyncio.Task | None = None
        self.changed = asyncio.Event()  # set when capacity may have grown
        self.foreign = False  # decide_mode()
        self.load_refused: Counter[str] = Counter()  # polls refused for what a worker said, by reason

    def set_workers(self, roles: dict[str, str], kinds: dict[str, str] | None = None) -> None:
        """The pool becomes these workers (url -> role given for it, "" when its own report says):
        new ones join unhealthy until polled, gone ones leave (their requests in flight finish)."""
        wanted = {u.rstrip("/"): r for u, r in roles.items()}
        for url in list(self.workers):
            if url not in wanted:
                log.info("worker %s left the pool", url)
                del self.workers[url]
        for url, role in wanted.items():
            if url not in self.workers:
                kind = (kinds or {}).get(url) or self.kind
                self.workers[url] = Worker(url, role=role or "unknown", kind=kind,
                                           breaker=CircuitBreaker(threshold=self._breaker[0],
                                                                  base_backoff_s=self._breaker[1]))

    async def start(self, wait_s: float = 0.0) -> None:
        """Poll every worker once (for up to ``wait_s`` until all answer), then keep polling."""
        started = time.monotonic()
        deadline = started + wait_s
        while True:
            await self.poll()
            now = time.monotonic()
            healthy = [w.healthy for w in self.workers.values()]
            if all(healthy) or now >= deadline or (any(healthy) and now - started >= 2.0):
                break
            await asyncio.sleep(0.2)
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def by_role(self, *roles: str, healthy: bool = True) -> list[Worker]:
        return [w for w in self.workers.values() if w.role in roles and (w.healthy or not healthy)
                and (self.foreign or not w.is_foreign)]

    def decide_mode(self) -> None:
        """Once at start: with any foreign worker every request goes the OpenAI way, to our workers
        too (their OpenAI API), since a foreign worker shares neither our tokenizer's token ids nor
        our internal protocol. A foreign worker that turns up later in a pool of ours is left out."""
        self.foreign = self.kind in ("vllm", "sglang", "openai") or any(w.is_foreign for w in self.workers.values())

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

    def mark_up(self, w: Worker) -> None:
        if not w.healthy:
            log.info("worker %s (%s, %s) is up", w.url, w.kind, w.role)
        w.healthy, w.down_since = True, None
        w.scraped_at, w.sent_since_scrape, w.blocks_since_scrape = time.monotonic(), 0, 0
        w.scrape_epoch += 1
        self.changed.set()

    async def _get(self, w: Worker, path: str, timeout_s: float) -> tuple[int, bytes]:
        if self.http is not None:
            return await http_get(self.http, f"{w.url}{path}", self.headers, timeout_s, MAX_SCRAPE_BYTES, LoadRefused)
        return await get_bounded(self.client, f"{w.url}{path}", self.headers, timeout_s)

    def poll_interval(self) -> float:
        """Seconds between two polls of a worker: the configured interval, longer when the workers
        are so many that the pool's GETs (two a vLLM or SGLang worker: /health and /metrics; one
        for others) would pass ``max_polls_per_s``, so that polling costs a bounded share of a core
        whatever the number of workers (its staleness bound grows alike: ``Worker.stale``)."""
        base = self.metrics_interval_s if self.foreign else self.interval_s
        gets = sum(2 if w.kind in ("vllm", "sglang") else 1 for w in self.workers.values())
        return max(base, gets / self.max_polls_per_s)

    async def _poll_one(self, w: Worker) -> None:
        try:
            if w.kind == "auto":
                w.kind = await self._detect(w)
            if w.kind == "cascade":
                status, body = await self._get(w, "/internal/load", 2.0)
                _raise_for(status, w.url, "/internal/load")
                w.report = checked_report(body)
                w.role = w.report.role
            else:
                await self._poll_foreign(w)
        except (httpx.HTTPError, ValueError, TimeoutError, Unreachable, WorkerBroke) as e:
            # refused: down at once; slow or odd (a loaded host): down when it happens twice in a row
            if isinstance(e, LoadRefused):
                self.load_refused[e.reason] += 1
                log.warning("worker %s: its load answer refused (%s): %s", w.url, e.reason, e)
            w.poll_failures += 1
            if isinstance(e, httpx.ConnectError | Unreachable) or w.poll_failures >= 2:
                self.mark_down(w.url, repr(e))
            return
        w.poll_failures = 0
        self.mark_up(w)

    async def _detect(self, w: Worker) -> str:
        """cascade when /internal/load answers as ours, else what /metrics names (or openai)."""
        status, body = await self._get(w, "/internal/load", 2.0)
        if status == 200:
            try:
                checked_report(body)
                return "cascade"
            except ValueError:
                pass
        status, body = await self._get(w, "/metrics", 2.0)
        kind = detect_kind(body.decode("utf-8", "replace")) if status == 200 else "openai"
        log.info("worker %s is %s (detected)", w.url, kind)
        return kind

    async def _poll_foreign(self, w: Worker) -> None:
        health = "/v1/models" if w.kind == "openai" else "/health"
        status, _ = await self._get(w, health, 3.0)
        _raise_for(status, w.url, health)
        if w.kind in ("vllm", "sglang"):
            status, body = await self._get(w, "/metrics", 3.0)
            _raise_for(status, w.url, "/metrics")
            w.foreign = parse_load(w.kind, body.decode("utf-8", "replace"))
        else:
            w.foreign = ForeignLoad()
        if w.role == "unknown":
            w.role = "both"

    async def _loop(self) -> None:
        while True:
            every = self.poll_interval()
            for w in self.workers.values():
                w.poll_every_s = every
            await asyncio.sleep(every)
            try:
                await self.poll()
            except Exception:  # never let the health loop die
                log.exception("worker poll failed")


def _raise_for(status: int, url: str, path: str) -> None:
    if not 200 <= status < 300:
        raise httpx.HTTPStatusError(f"{url}{path} answered {status}", request=httpx.Request("GET", f"{url}{path}"),
                                    response=httpx.Response(status))
