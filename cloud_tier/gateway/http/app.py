"""``build_app(config, worker_urls)``: the gateway. The lifespan opens its stores (SQLite and
in-process, or PostgreSQL and Redis: ``pipeline.stores.open_stores``), finds the workers and takes the
model's names and tokenizer from one of them (``workers.served``: the gateway never holds the
model, nor torch), and runs the batch runner beside the routes."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import httpx
from fastapi import FastAPI

from cascade.web import build_openai_app
from cloud_tier import tokenizer_files
from cloud_tier.config import CloudConfig, GatewayConfig
from cloud_tier.gateway.batch.files import FileLimits
from cloud_tier.gateway.batch.routes import UPLOAD_FORM_OVERHEAD, batch_api
from cloud_tier.gateway.batch.runner import BatchRunner, RunnerConfig
from cloud_tier.gateway.batch.store import BatchStore
from cloud_tier.gateway.http.body_limit import BodyLimit
from cloud_tier.gateway.http.routes import admin, generation, ops, v1
from cloud_tier.gateway.pipeline.service import GatewayService
from cloud_tier.gateway.pipeline.stores import batch_db_path, open_stores
from cloud_tier.gateway.workers.http_client import WorkerHTTP
from cloud_tier.gateway.workers.http_pool import KEEPALIVE_EXPIRY_S, ShardedTransport
from cloud_tier.gateway.workers.pool import WorkerPool
from cloud_tier.gateway.workers.served import first_worker, foreign_models, served_model
from cloud_tier.request_builder import RequestBuilder
from sync.idempotency import IdempotencyRecords

log = logging.getLogger(__name__)
T = TypeVar("T")


def worker_roles(config: CloudConfig, worker_urls: list[str]) -> dict[str, str]:
    """url -> the role it was given ("" when its own report says): --prefill/--decode URLs."""
    g = config.gateway
    roles = {u: "" for u in worker_urls}
    for field, role in ((g.prefill_workers, "prefill"), (g.decode_workers, "decode")):
        roles.update({u.strip(): role for u in field.split(",") if u.strip()})
    return roles


async def _open_pool(config: CloudConfig, worker_urls: list[str], client: httpx.AsyncClient, http: WorkerHTTP
                     ) -> tuple[WorkerPool, asyncio.Task | None]:
    """The pool, started and in its mode (our workers or foreign ones), and the task that follows
    k8s discovery (None without it)."""
    g = config.gateway
    roles = worker_roles(config, worker_urls)
    pool = WorkerPool(list(roles), client, config.server.api_key, g.health_interval_s, kind=g.worker_type,
                      roles=roles, metrics_interval_s=g.metrics_interval_s,
                      breaker_threshold=g.breaker_threshold, breaker_open_s=g.breaker_open_s, http=http,
                      max_polls_per_s=g.max_polls_per_s)
    watcher = None
    if g.k8s_discovery:  # the pool follows the ready pods the selectors match
        from cloud_tier.gateway.workers.discovery import KubernetesDiscovery, follow

        discovery = KubernetesDiscovery(g.k8s_namespace, g.k8s_selector, g.k8s_prefill_selector,
                                        g.k8s_decode_selector, port=g.k8s_port)
        watcher = asyncio.create_task(follow(discovery, lambda found: pool.set_workers(
            {d.url: d.role for d in found}, {d.url: d.worker_type for d in found})))
        await first_worker(pool, g.startup_timeout_s)
    await pool.start(wait_s=30.0)
    pool.decide_mode()
    return pool, watcher


async def _service(config: CloudConfig, pool: WorkerPool, stores, client: httpx.AsyncClient, http: WorkerHTTP
                   ) -> GatewayService:
    """The pipeline over ``pool``, with the model its workers serve."""
    g = config.gateway
    if pool.foreign:
        names, max_len = await foreign_models(pool, g.startup_timeout_s)
        builder = None  # the body goes to the worker as it is: the worker's tokenizer is the one
        model_id, aliases, max_model_len = names[0], set(names[1:]), max_len
    else:
        model = await served_model(pool, g.startup_timeout_s)
        tokenizer = await asyncio.to_thread(tokenizer_files.load, model.tokenizer_files)
        builder = RequestBuilder(tokenizer, pool.max_model_len or model.max_model_len,
                                 tokenizer_identity=model.tokenizer_identity, model_vocab_size=model.vocab_size)
        model_id, aliases, max_model_len = model.model, set(model.aliases), builder.max_model_len
    svc = GatewayService(g, pool, stores, builder, model_id, aliases, client, config.server.api_key,
                         max_model_len, http)
    svc.embedding_identity = "" if pool.foreign else model.embedding_identity
    return svc


def _runner_config(g: GatewayConfig) -> RunnerConfig:
    return RunnerConfig(
        concurrency=g.batch_concurrency, kv_share=g.batch_kv_share, online_busy=g.batch_online_busy,
        max_lines=g.batch_max_lines, backoff_s=g.batch_backoff_s, backoff_max_s=g.batch_backoff_max_s,
        max_refusals=g.batch_max_refusals, max_line_bytes=g.max_body_bytes)


async def until_stopped(work: Awaitable[T], stopping: Callable[[], bool], every_s: float = 0.2) -> T:
    """``work``'s result, unless the server is told to stop first: a SIGTERM while the gateway waits for
    its workers (up to ``startup_timeout_s``) is only noted by uvicorn until the startup ends, so without
    this the process would hold out that long."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=every_s)
            if not task.done() and stopping():
                raise RuntimeError("stopped while waiting for the workers")
        return task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task


def build_app(config: CloudConfig, worker_urls: list[str], stopping: Callable[[], bool] = lambda: False
              ) -> FastAPI:
    """The gateway's app; ``stopping()`` says the server has been told to stop (uvicorn's should_exit)."""
    g = config.gateway

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stores = open_stores(config)
        client = httpx.AsyncClient(timeout=httpx.Timeout(g.request_timeout_s, connect=g.connect_timeout_s),
                                   transport=ShardedTransport(httpx.Limits(
                                       max_connections=1024, max_keepalive_connections=128,
                                       keepalive_expiry=KEEPALIVE_EXPIRY_S)))
        # aiohttp sessions: the relay's (no cap on connections: admission bounds the requests in flight), and
        # the polls' own, so that no number of open streams keeps a health check from a connection
        http, polls = WorkerHTTP(g.connect_timeout_s, g.request_timeout_s, max_connections=0), WorkerHTTP(
            g.connect_timeout_s, max_connections=64)
        pool, watcher = await until_stopped(_open_pool(config, worker_urls, client, polls), stopping)
        app.state.service = await until_stopped(_service(config, pool, stores, client, http), stopping)
        collector = asyncio.create_task(_collect(stores.idempotency))
        app.state.batches = BatchStore(batch_db_path(g), limits=FileLimits(
            g.batch_tenant_max_bytes, g.batch_tenant_max_files, g.batch_file_ttl_s))
        runner = asyncio.create_task(BatchRunner(app.state.service, app.state.batches, _runner_config(g)).run())
        quiet_gc()
        try:
            yield
        finally:
            runner.cancel()
            await asyncio.gather(runner, return_exceptions=True)  # its lines settle before the pool closes
            app.state.batches.close()
            collector.cancel()
            if watcher is not None:
                watcher.cancel()
            await pool.close()
            await http.close()
            await polls.close()
            await client.aclose()
            await stores.aclose()

    app = build_openai_app("cascade cloud gateway", lifespan, config, "cloud", generation, ops, v1, admin,
                           batch_api)
    app.add_middleware(BodyLimit, limit=g.max_body_bytes,
                       routes={("POST", "/v1/files"): g.batch_max_file_bytes + UPLOAD_FORM_OVERHEAD})
    return app


def quiet_gc() -> None:
    """What the started gateway holds (modules, the tokenizer, the pool) is moved out of the
    collector's sight, and its young generation collected every 20,000 allocations instead of 700:
    a relayed chunk allocates a few dicts that reference counting frees, and the collector's runs
    over everything else were ~5% of the relay's CPU (py-spy --native)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)


async def _collect(idem: IdempotencyRecords, every_s: float = 600.0) -> None:
    while True:
        with contextlib.suppress(Exception):
            n = await asyncio.to_thread(idem.collect_expired)
            if n:
                log.info("collected %d expired idempotency keys", n)
        await asyncio.sleep(every_s)
