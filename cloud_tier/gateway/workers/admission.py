"""Admission control on the decode pool's KV blocks: a request is admitted only if its
predicted peak KV (prompt + max_tokens, in blocks) fits under a worker's high watermark after
what is already committed there. Otherwise it waits in a bounded line, but only if the drain
rate says it will fit before its time-to-first-token deadline; else 429 + Retry-After now,
rather than being served late. A request that could never fit is a 400. Between tenants, an
online request also passes the fair-share pass (``tenant_share``): it leaves free the room kept for
the other active tenants."""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import deque
from dataclasses import dataclass

from cascade import errors
from cloud_tier.config import GatewayConfig
from cloud_tier.gateway.tenants.tenant_share import TenantShares
from cloud_tier.gateway.workers.placement import WorkerLoad, choose_decode, fits_ever, watermark_blocks
from cloud_tier.gateway.workers.pool import Worker, WorkerPool


@dataclass
class Ticket:
    """Blocks committed on one worker until ``Admission.release``."""

    worker: Worker
    blocks: int
    released: bool = False
    epoch: int = -1  # the worker's scrape it was sent after (foreign workers: its count lags until the next)
    probe: bool = False  # it is the half-open breaker's one probe
    batch: bool = False  # for a batch-class request: online requests may take its blocks (the engine preempts it)
    tenant: str = ""  # whose fair share of KV it counts in (online requests)


class Admission:
    def __init__(self, pool: WorkerPool, high_watermark: float = 0.9, max_queue: int = 64,
                 rng: random.Random | None = None, window_s: float = 30.0, shares: TenantShares | None = None):
        """``shares``: the tenants' fair shares of KV (None: first come, first served between tenants)."""
        self.pool = pool
        self.shares = shares
        self.high_watermark = high_watermark
        self.max_queue = max_queue
        self.rng = rng or random.Random(0)
        self.window_s = window_s
        self.waiting = 0
        self._released: deque[tuple[float, int]] = deque()  # (when, blocks) for the drain rate

    @classmethod
    def of(cls, pool: WorkerPool, config: GatewayConfig) -> Admission:
        """The gateway's admission as ``config`` says (``[gateway] kv_high_watermark``, ``max_queue``,
        ``tenant_kv_fair``, ``tenant_kv_window_s``)."""
        shares = TenantShares(config.tenant_kv_window_s) if config.tenant_kv_fair else None
        return cls(pool, config.kv_high_watermark, config.max_queue, shares=shares)

    def drain_rate(self) -> float:
        """KV blocks given back per second, over the last window."""
        now = time.monotonic()
        while self._released and self._released[0][0] < now - self.window_s:
            self._released.popleft()
        if not self._released:
            return 0.0
        span = max(now - self._released[0][0], 1.0)
        return sum(b for _, b in self._released) / span

    async def admit(self, need_blocks: int, deadline_s: float, roles: tuple[str, ...],
                    reason: str = "kv_capacity", batch: bool = False, tenant: str = "") -> Ticket:
        """A worker with room for ``need_blocks``, waiting at most ``deadline_s`` for one; else 429 +
        Retry-After with ``reason`` as its code ("slo" where the wait is the request's own TTFT target).
        ``batch``: a batch-class request; any other may count the blocks committed to those as free,
        since our engines preempt batch requests for it (batch work runs in what online work leaves).
        ``tenant``: whose fair share an online request counts in."""
        ticket = self._try(need_blocks, roles, batch, tenant)
        if ticket is not None:
            return ticket
        deficit = self._deficit(need_blocks, roles, batch)
        rate = self.drain_rate()
        estimate = deficit / rate if rate > 0 else None
        if self.waiting >= self.max_queue:
            raise _busy("The cloud tier's admission queue is full.", estimate or 1.0, "queue_full")
        if estimate is not None and estimate > deadline_s:
            raise _busy("Not enough KV cache free to start this request within the time-to-first-token "
                        "objective.", estimate, reason)
        self.waiting += 1
        fair = self.shares is not None and not batch
        try:
            if fair:
                self.shares.wait(tenant, need_blocks)
            end = time.monotonic() + deadline_s
            while time.monotonic() < end:
                await asyncio.sleep(0.02)
                ticket = self._try(need_blocks, roles, batch, tenant)
                if ticket is not None:
                    return ticket
        finally:
            self.waiting -= 1
            if fair:
                self.shares.unwait(tenant, need_blocks)
        rate = self.drain_rate()
        raise _busy("Not enough KV cache became free within the time-to-first-token objective.",
                    self._deficit(need_blocks, roles, batch) / rate if rate > 0 else deadline_s, reason)

    def release(self, ticket: Ticket) -> None:
        if ticket.released:
            return
        ticket.released = True
        w = ticket.worker
        w.committed_blocks -= ticket.blocks
        if ticket.batch:
            w.batch_blocks -= ticket.blocks
        elif self.shares is not None:
            self.shares.gave_back(ticket.tenant, ticket.blocks)
        w.in_flight -= 1
        if ticket.probe and w.breaker is not None:
            w.breaker.abandon()  # ended without a success or failure (the client left): the next one probes
        if ticket.epoch == w.scrape_epoch:  # it came and went between two scrapes: no longer load
            w.sent_since_scrape -= 1
            w.blocks_since_scrape -= ticket.blocks
        self._released.append((time.monotonic(), ticket.blocks))

    def _try(self, need: int, roles: tuple[str, ...], batch: bool = False, tenant: str = "") -> Ticket | None:
        workers = self.pool.by_role(*roles)
        if not workers:
            raise errors.APIError(503, "No healthy cloud worker is available.", "server_error",
                                  code="no_workers", headers={"Retry-After": "1"})
        loads = [w.load(over_batch=not batch) for w in workers]
        if not fits_ever(loads, need, self.high_watermark):
            raise errors.bad_request(
                f"This request may need {need} KV blocks (prompt + max_tokens), more than any worker "
                "can hold; lower max_tokens.", "max_tokens", "kv_capacity_exceeded")
        if not batch and not self._fair(tenant, need, loads):
            return None
        choice = choose_decode(loads, need, self.high_watermark, self.rng)
        if choice is None:
            return None
        worker = self.pool.workers[choice.worker_id]
        worker.committed_blocks += need
        if batch:
            worker.batch_blocks += need
        elif self.shares is not None:
            self.shares.took(tenant, need)
        worker.in_flight += 1
        return Ticket(worker, need, batch=batch, tenant=tenant)

    def _fair(self, tenant: str, need: int, loads: list[WorkerLoad]) -> bool:
        """The fair-share pass: whether ``tenant`` may take ``need`` blocks of the pool's room under
        the watermark, leaving what is kept for the other tenants (``TenantShares.allows``)."""
        if self.shares is None:
            return True
        healthy = [w for w in loads if w.healthy]
        pool = sum(watermark_blocks(w, self.high_watermark) for w in healthy)
        free = sum(max(0, watermark_blocks(w, self.high_watermark) - w.kv_blocks_used) for w in healthy)
        return self.shares.allows(tenant, need, free, pool)

    def _deficit(self, need: int, roles: tuple[str, ...], batch: bool = False) -> float:
        loads = [w.load(over_batch=not batch) for w in self.pool.by_role(*roles)]
        return max(0.0, min((w.kv_blocks_used + need - self.high_watermark * w.kv_blocks_total
                             for w in loads), default=need))


def _busy(message: str, retry_after_s: float, code: str) -> errors.APIError:
    return errors.too_many_requests(message, max(1.0, math.ceil(min(retry_after_s, 3600.0))), code)
