"""``build_app(config, worker_urls)``: the gateway. The lifespan opens its stores (SQLite and
in-process, or PostgreSQL and Redis: ``stores.open_stores``), finds the workers and takes the
model's names and tokenizer from one of them (the gateway never holds the model, nor torch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from cascade.web import build_openai_app
from cloud_tier import tokenizer_files
from cloud_tier.config import CloudConfig
from cloud_tier.disagg.protocol import ServedModel
from cloud_tier.gateway.routes import admin, ops, v1
from cloud_tier.gateway.service import GatewayService
from cloud_tier.gateway.stores import open_stores
from cloud_tier.gateway.worker_pool import WorkerPool
from cloud_tier.request_builder import RequestBuilder
from sync.idempotency import IdempotencyRecords

log = logging.getLogger(__name__)


async def served_model(pool: WorkerPool, timeout_s: float) -> ServedModel:
    """The model's names and tokenizer, from the first worker that gives them."""
    deadline = time.monotonic() + timeout_s
    last_error = "no worker answered"
    while True:
        for w in pool.workers.values():
            try:
                r = await pool.client.get(f"{w.url}/internal/tokenizer", headers=pool.headers, timeout=60.0)
                r.raise_for_status()
                return ServedModel.model_validate_json(r.content)
            except (httpx.HTTPError, ValueError) as e:
                last_error = f"{w.url}: {e!r}"
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no worker gave the model's tokenizer in {timeout_s:.0f} s ({last_error})")
        log.info("waiting for a worker to give the model's tokenizer (%s)", last_error)
        await asyncio.sleep(2.0)


def build_app(config: CloudConfig, worker_urls: list[str]) -> FastAPI:
    g = config.gateway

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stores = open_stores(config)
        client = httpx.AsyncClient(timeout=httpx.Timeout(g.request_timeout_s, connect=5.0),
                                   limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128))
        pool = WorkerPool(worker_urls, client, config.server.api_key, g.health_interval_s)
        await pool.start(wait_s=30.0)
        model = await served_model(pool, g.startup_timeout_s)
        tokenizer = await asyncio.to_thread(tokenizer_files.load, model.tokenizer_files)
        builder = RequestBuilder(tokenizer, pool.max_model_len or model.max_model_len)
        app.state.service = GatewayService(g, pool, stores, builder, model.model, set(model.aliases), client,
                                           config.server.api_key)
        collector = asyncio.create_task(_collect(stores.idempotency))
        try:
            yield
        finally:
            collector.cancel()
            await pool.close()
            await client.aclose()
            stores.close()

    return build_openai_app("cascade cloud gateway", lifespan, config, "cloud", ops, v1, admin)


async def _collect(idem: IdempotencyRecords, every_s: float = 600.0) -> None:
    while True:
        with contextlib.suppress(Exception):
            n = await asyncio.to_thread(idem.collect_expired)
            if n:
                log.info("collected %d expired idempotency keys", n)
        await asyncio.sleep(every_s)
