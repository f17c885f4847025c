"""``build_app(config, worker_urls)``: the gateway. The lifespan opens the key and idempotency
stores, finds the workers and loads the model's tokenizer (never the model)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
from fastapi import FastAPI

from cascade.api import build_openai_app
from cascade.config import cascade_home
from cloud_tier.config import CloudConfig
from cloud_tier.gateway.keys import KeyStore
from cloud_tier.gateway.routes import admin, router, v1
from cloud_tier.gateway.service import GatewayService
from cloud_tier.gateway.workers import WorkerPool
from cloud_tier.request_builder import RequestBuilder
from sync.idempotency import IdempotencyStore

log = logging.getLogger(__name__)


def db_path(config: CloudConfig) -> Path:
    path = Path(config.gateway.db) if config.gateway.db else cascade_home() / "cloud" / "gateway.db"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def load_tokenizer(model: str):
    from transformers import AutoTokenizer

    from cloud_tier.engine.llm_engine import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir(model))


def build_app(config: CloudConfig, worker_urls: list[str]) -> FastAPI:
    g = config.gateway

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        from cloud_tier.worker.app import served_names

        db = db_path(config)
        keys = KeyStore(db)
        idem = IdempotencyStore(db.with_name("idempotency.db"), ttl_s=g.idempotency_ttl_s)
        client = httpx.AsyncClient(timeout=httpx.Timeout(g.request_timeout_s, connect=5.0),
                                   limits=httpx.Limits(max_connections=1024, max_keepalive_connections=128))
        pool = WorkerPool(worker_urls, client, config.server.api_key, g.health_interval_s)
        await pool.start(wait_s=30.0)
        tokenizer = await asyncio.to_thread(load_tokenizer, config.engine.model)
        builder = RequestBuilder(tokenizer, pool.max_model_len or config.engine.max_model_len)
        name, aliases = served_names(config.engine.model)
        app.state.service = GatewayService(g, pool, keys, idem, builder, name, aliases, client,
                                           config.server.api_key)
        collector = asyncio.create_task(_collect(idem))
        try:
            yield
        finally:
            collector.cancel()
            await pool.close()
            await client.aclose()
            idem.close()
            keys.close()

    return build_openai_app("cascade cloud gateway", lifespan, config, "cloud", router, v1, admin)


async def _collect(idem: IdempotencyStore, every_s: float = 600.0) -> None:
    while True:
        with contextlib.suppress(Exception):
            n = await asyncio.to_thread(idem.collect_expired)
            if n:
                log.info("collected %d expired idempotency keys", n)
        await asyncio.sleep(every_s)
