"""``build_app(config)``: one engine behind the OpenAI API. The lifespan loads the model and
starts the engine thread; handlers read the service from ``app.state``."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from cascade.api import build_openai_app
from cloud_tier.config import CloudConfig
from cloud_tier.disagg.decode import DecodeService
from cloud_tier.disagg.prefill import PrefillService
from cloud_tier.engine.async_engine import AsyncLLMEngine
from cloud_tier.engine.config import EngineConfig
from cloud_tier.engine.llm_engine import LLMEngine
from cloud_tier.worker.metrics import WorkerMetrics
from cloud_tier.worker.routes import internal, router, v1
from cloud_tier.worker.service import WorkerService


def engine_config(config: CloudConfig) -> EngineConfig:
    e = config.engine
    return EngineConfig(model=e.model, dtype=e.dtype, device=e.device, block_size=e.block_size,
                        kv_cache_memory_bytes=e.kv_cache_memory_bytes, max_model_len=e.max_model_len,
                        max_num_seqs=e.max_num_seqs, max_num_batched_tokens=e.max_num_batched_tokens,
                        enable_prefix_caching=e.enable_prefix_caching,
                        enable_chunked_prefill=e.enable_chunked_prefill, threads=e.threads)


def served_names(model: str) -> tuple[str, set[str]]:
    """The id clients use for the model, and the other names accepted for it."""
    from model_distribution.catalog import PACKAGED

    for p in PACKAGED:
        if model.lower() in (p.name, *p.aliases):
            return p.name, {*p.aliases, model}
    return model, {model}


def build_app(config: CloudConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = await asyncio.to_thread(LLMEngine, engine_config(config))
        async_engine = AsyncLLMEngine(engine)
        name, aliases = served_names(config.engine.model)
        role = config.worker.role
        client = httpx.AsyncClient(timeout=httpx.Timeout(config.worker.prefill_timeout_s, connect=5.0),
                                   limits=httpx.Limits(max_connections=256, max_keepalive_connections=64))
        prefill = PrefillService(async_engine, config.worker.prefill_timeout_s) if role in ("prefill", "both") else None
        decode = None
        if role in ("decode", "both"):
            decode = DecodeService(async_engine, client, config.server.api_key)
            await decode.start(config.worker.kv_host or config.server.host, config.worker.kv_port)
        app.state.service = WorkerService(async_engine, name, aliases, WorkerMetrics(), role,
                                          prefill=prefill, decode=decode)
        try:
            yield
        finally:
            if decode is not None:
                await decode.close()
            await client.aclose()
            async_engine.shutdown()

    return build_openai_app("cascade cloud worker", lifespan, config, "cloud", router, v1, internal)
