"""A worker's word on its load, checked before it reaches placement, admission, a gauge or a timer:
the one place those numbers are read (our workers' ``/internal/load`` here, a foreign worker's
``/metrics`` in ``workers.metrics_scrape``, through ``count``).

A poll's body is read bounded (``MAX_SCRAPE_BYTES``, refused as soon as it passes that) and within
one deadline for the whole answer. A number that is not one (a string, a bool, NaN, an infinity, a
negative) refuses the whole poll with a ``LoadRefused`` naming why (the pool counts it by reason,
``cascade_gateway_worker_load_refused_total``, and treats the poll as failed: the worker's last good
numbers stay, it goes down when it happens twice in a row); a number past what any worker has
(``MAX_REQUESTS`` requests, ``MAX_KV_BLOCKS`` blocks...) is clamped to it."""

from __future__ import annotations

import asyncio
import math

import httpx
from pydantic import ValidationError

from cascade import wire
from cloud_tier.disagg.protocol import WorkerLoadReport

MAX_SCRAPE_BYTES = 4 << 20  # a vLLM scrape is ~50 KB
MAX_REQUESTS = 1 << 20  # requests waiting or running on one worker
MAX_KV_BLOCKS = 1 << 32
MAX_KV_TOKENS = 1 << 40
MAX_BLOCK_SIZE = 1 << 16
MAX_MODEL_LEN = 1 << 24
MAX_COUNTER = 1 << 62  # a cumulative counter (prefix cache queries)
REASONS = ("too_large", "not_json", "bad_report", "not_prometheus", "not_number", "non_finite", "negative",
           "out_of_range")


class LoadRefused(ValueError):
    """A worker's load answer refused; ``reason`` is one of ``REASONS``."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def count(value: object, what: str, most: float) -> float:
    """``value`` as a number from 0 up to ``most`` (clamped); LoadRefused when it is not a finite
    number >= 0. A string is taken as Prometheus writes a number (a label's value)."""
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            raise LoadRefused("not_number", f"{what} is not a number: {value[:40]!r}") from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LoadRefused("not_number", f"{what} is not a number: {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise LoadRefused("non_finite", f"{what} is {value}")
    if value < 0:
        raise LoadRefused("negative", f"{what} is negative: {value}")
    return min(value, most)


def whole(value: object, what: str, most: int) -> int:
    """``count`` as an integer (rounded down)."""
    return int(count(value, what, most))


_BOUNDS = {"max_model_len": MAX_MODEL_LEN, "block_size": MAX_BLOCK_SIZE, "kv_blocks_total": MAX_KV_BLOCKS,
           "kv_blocks_free": MAX_KV_BLOCKS, "waiting": MAX_REQUESTS, "running": MAX_REQUESTS,
           "prefix_cache_queries": MAX_COUNTER, "prefix_cache_hits": MAX_COUNTER}


def checked_report(body: bytes) -> WorkerLoadReport:
    """Our worker's ``/internal/load`` body: strict JSON (no NaN, no integer past 64 bits), every
    field of its declared type (no "5" for 5, no 2.5, no true), every number >= 0 and clamped to its
    bound, free blocks at most the total, hits at most the queries; LoadRefused otherwise."""
    try:
        data = wire.loads(body, limit=MAX_SCRAPE_BYTES)
        report = WorkerLoadReport.model_validate(data, strict=True)
    except wire.WireError as e:
        raise LoadRefused("too_large" if e.reason == "too_large" else "not_json", f"load report: {e}") from None
    except ValidationError as e:
        raise LoadRefused("bad_report", f"load report: {str(e)[:300]}") from None
    fixed = {name: whole(getattr(report, name), name, most) for name, most in _BOUNDS.items()}
    if fixed["block_size"] < 1 or fixed["max_model_len"] < 1:
        raise LoadRefused("out_of_range", f"load report: block_size {report.block_size}, max_model_len "
                                          f"{report.max_model_len}: both must be >= 1")
    fixed["kv_blocks_free"] = min(fixed["kv_blocks_free"], fixed["kv_blocks_total"])
    fixed["prefix_cache_hits"] = min(fixed["prefix_cache_hits"], fixed["prefix_cache_queries"])
    return report.model_copy(update=fixed)


async def get_bounded(client: httpx.AsyncClient, url: str, headers: dict, timeout_s: float,
                      limit: int = MAX_SCRAPE_BYTES) -> tuple[int, bytes]:
    """(status, body) of ``GET url``, the whole answer within ``timeout_s`` (TimeoutError past it: a
    worker that drips its body never holds a poll), the body refused (LoadRefused ``too_large``) as
    soon as it passes ``limit`` bytes, never read whole."""
    async with asyncio.timeout(timeout_s):
        async with client.stream("GET", url, headers=headers, timeout=timeout_s) as r:
            declared = r.headers.get("content-length", "")
            if declared.isascii() and declared.isdigit() and int(declared) > limit:
                raise LoadRefused("too_large", f"{url}: a body of {declared} bytes (over {limit})")
            body = bytearray()
            async for data in r.aiter_bytes():
                body += data
                if len(body) > limit:
                    raise LoadRefused("too_large", f"{url}: a body over {limit} bytes")
            return r.status_code, bytes(body)
