"""Choosing an OpenAI-compatible worker without the model's tokenizer: load from the worker's own
numbers (scraped) plus what the gateway sent it since, prefix affinity from 64-character block
hashes, and admission: a worker whose pressure reaches 1 (its waiting requests at
``max_waiting`` or its KV cache at the high watermark, or numbers older than ``stale_after_s``)
is saturated; when every worker is, the request gets 429 + Retry-After. Lower-standing requests
(a larger key priority) are shed earlier: priority p > 0 once the best worker's pressure passes
``1 - shed_step * p`` (never below 0.5)."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from cascade import errors
from cloud_tier.gateway.workers.admission import Ticket
from cloud_tier.gateway.workers.placement import TEXT_BLOCK_CHARS, PrefixIndex
from cloud_tier.gateway.workers.pool import Worker


@dataclass(frozen=True)
class ForeignRouting:
    max_waiting: int = 8
    kv_high_watermark: float = 0.9
    stale_after_s: float = 3.0
    shed_step: float = 0.1
    prefix_weight: float = 2.0
    queue_weight: float = 1.0
    kv_weight: float = 1.0
    affinity_queue_gap: int = 4  # a holder with this many more requests than the least loaded is overloaded


def _kv_blocks(w: Worker) -> int:
    """KV capacity in 16-token blocks, from what the worker reports (0: unknown)."""
    if w.report is not None:
        return w.report.kv_blocks_total
    if w.foreign is not None and w.foreign.kv_tokens:
        return max(1, w.foreign.kv_tokens // 16)
    return 0


def text_blocks_held(w: Worker) -> int | None:
    """How many 64-character prompt blocks fit in the worker's KV cache (~4 characters a token)."""
    tokens = _kv_blocks(w) * 16
    return tokens * 4 // TEXT_BLOCK_CHARS if tokens else None


def queue_of(w: Worker) -> float:
    if w.report is not None:
        scraped = w.report.waiting + w.report.running
    elif w.foreign is not None:
        scraped = w.foreign.waiting + w.foreign.running
    else:
        scraped = 0
    return max(scraped + w.sent_since_scrape, w.in_flight)


def pressure(w: Worker, cfg: ForeignRouting, now: float) -> float:
    if w.stale(now, cfg.stale_after_s):
        return math.inf
    if w.report is not None:
        r = w.report
        waiting = r.waiting
        kv = (r.kv_blocks_total - r.kv_blocks_free) / r.kv_blocks_total if r.kv_blocks_total else 0.0
    else:
        f = w.foreign
        waiting, kv = (f.waiting, f.kv_usage) if f is not None else (0.0, 0.0)
    blocks = _kv_blocks(w)
    kv += w.blocks_since_scrape / blocks if blocks else 0.0
    waiting += w.sent_since_scrape
    return max(waiting / cfg.max_waiting, kv / cfg.kv_high_watermark)


def pressure_limit(priority: int, cfg: ForeignRouting) -> float:
    return 1.0 if priority <= 0 else max(0.5, 1.0 - cfg.shed_step * priority)


def choose(workers: Sequence[Worker], index: PrefixIndex, hashes: list[int], priority: int,
           cfg: ForeignRouting, need_blocks: int, exclude: frozenset[str] = frozenset()) -> tuple[Ticket, int]:
    """A ticket on the best worker and its prefix hit in blocks; APIError 503 (none available) or
    429 (all saturated for this priority)."""
    now = time.monotonic()
    live = [w for w in workers if w.available() and w.url not in exclude]
    if not live:
        raise errors.APIError(503, "No healthy cloud worker is available.", "server_error", code="no_workers",
                              headers={"Retry-After": "1"})
    limit = pressure_limit(priority, cfg)
    open_ = [w for w in live if pressure(w, cfg, now) < limit]
    if not open_:
        best = min(pressure(w, cfg, now) for w in live)
        why = "stale load reports" if math.isinf(best) else "its queues and KV caches"
        raise errors.too_many_requests(
            f"The cloud tier is saturated ({why}); retry later.", 2.0 if math.isinf(best) else 1.0,
            "pool_saturated")
    hits = index.match_hashes(hashes) if hashes else {}
    queues = {w.url: queue_of(w) for w in open_}
    least = min(queues.values())
    top = max(max(queues.values()), 1.0)

    def counted_hit(w: Worker) -> int:
        return 0 if queues[w.url] >= least + cfg.affinity_queue_gap else hits.get(w.url, 0)

    def score(w: Worker) -> float:
        kv = w.foreign.kv_usage if w.foreign is not None else 0.0
        share = counted_hit(w) / len(hashes) if hashes else 0.0
        return cfg.prefix_weight * share - cfg.queue_weight * queues[w.url] / top - cfg.kv_weight * kv

    best = min(open_, key=lambda w: (-score(w), queues[w.url], w.url))
    probe = best.breaker is not None and best.breaker.state == "half_open"
    if best.breaker is not None:
        best.breaker.allow()  # in half-open: this request is the one probe
    best.sent_since_scrape += 1
    best.blocks_since_scrape += need_blocks
    best.committed_blocks += need_blocks
    best.in_flight += 1
    if hashes:
        held = text_blocks_held(best)
        if held:
            index.set_capacity(best.url, held)
        index.insert_hashes(best.url, hashes)
    return Ticket(best, need_blocks, epoch=best.scrape_epoch, probe=probe), hits.get(best.url, 0)
