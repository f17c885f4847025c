"""``build_app(config)``: one engine behind the OpenAI API. The lifespan loads the model and
starts the engine thread; handlers read the service from ``app.state``."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI

from cascade.web import build_openai_app
from cloud_tier.config import CloudConfig
from cloud_tier.disagg.decode import DecodeService
from cloud_tier.disagg.prefill import PrefillService
from cloud_tier.engine.async_engine import AsyncLLMEngine
from cloud_tier.engine.llm_engine import LLMEngine
from cloud_tier.worker.metrics import WorkerMetrics
from cloud_tier.worker.routes import internal, ops, v1
from cloud_tier.worker.service import WorkerService
from model_distribution.artifacts.catalog import served_names


def build_app(config: CloudConfig) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine = await asyncio.to_thread(LLMEngine, config.engine)
        await asyncio.to_thread(engine.calibrate)  # the scheduler's TTFT/TPOT estimates start from this machine
        async_engine = AsyncLLMEngine(engine)
        # llguidance's view of the tokenizer (about a second for 150k tokens), off the event loop
        warm_guides = asyncio.create_task(asyncio.to_thread(engine.guides.warm))
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
            await warm_guides
            if decode is not None:
                await decode.close()
            await client.aclose()
            async_engine.shutdown()

    return build_openai_app("cascade cloud worker", lifespan, config, "cloud", ops, v1, internal)
