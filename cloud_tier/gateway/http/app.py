"""``build_app(config, worker_urls)``: the gateway. The lifespan opens its stores (SQLite and
in-process, or PostgreSQL and Redis: ``pipeline.stores.open_stores``), finds the workers and takes the
model's names and tokenizer from one of them (the gateway never holds the model, nor torch)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from cascade.web import build_openai_app
from cloud_tier import tokenizer_files
from cloud_tier.config import CloudConfig
from cloud_tier.disagg.protocol import ServedModel
from cloud_tier.gateway.batch.files import FileLimits
from cloud_tier.gateway.batch.routes import UPLOAD_FORM_OVERHEAD, batch_api, body_too_large
from cloud_tier.gateway.batch.runner import BatchRunner, RunnerConfig
from cloud_tier.gateway.batch.store import BatchStore
from cloud_tier.gateway.http.routes import admin, generation, ops, v1
from cloud_tier.gateway.pipeline.service import GatewayService
from cloud_tier.gateway.pipeline.stores import batch_db_path, open_stores
from cloud_tier.gateway.workers.http_pool import KEEPALIVE_EXPIRY_S, ShardedTransport
from cloud_tier.gateway.workers.pool import WorkerPool
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


async def foreign_models(pool: WorkerPool, timeout_s: float) -> tuple[list[str], int | None]:
    """The model names OpenAI-compatible workers serve (their /v1/models, all of them) and the
    shortest max_model_len they state (vLLM does), waiting for at least one to answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        names: list[str] = []
        lens: list[int] = []
        last_error = "no worker answered"
        for w in pool.workers.values():
            try:
                r = await pool.client.get(f"{w.url}/v1/models", headers=pool.headers, timeout=10.0)
                r.raise_for_status()
                for card in r.json().get("data") or ():
                    if isinstance(card, dict) and isinstance(card.get("id"), str):
                        names.append(card["id"]) if card["id"] not in names else None
                        n = card.get("max_model_len")
                        if isinstance(n, int) and n > 0:
                            lens.append(n)
            except (httpx.HTTPError, ValueError, AttributeError) as e:
                last_error = f"{w.url}: {e!r}"
        if names:
            return names, min(lens) if lens else None
        if time.monotonic() >= deadline:
            raise RuntimeError(f"no worker listed its models in {timeout_s:.0f} s ({last_error})")
        log.info("waiting for a worker to list its models (%s)", last_error)
        await asyncio.sleep(2.0)


async def _first_worker(pool: WorkerPool, timeout_s: float) -> None:
    """Until discovery has found a worker (its kind decides how the gateway talks to the pool)."""
    deadline = time.monotonic() + timeout_s
    while not pool.workers:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"k8s discovery found no ready worker pod in {timeout_s:.0f} s")
        await asyncio.sleep(1.0)


def worker_roles(config: CloudConfig, worker_urls: list[str]) -> dict[str, str]:
    """url -> the role it was given ("" when its own report says): --prefill/--decode URLs."""
    g = config.gateway
    roles = {u: "" for u in worker_urls}
    for field, role in ((g.prefill_workers, "prefill"), (g.decode_workers, "decode")):
        roles.update({u.strip(): role for u in field.split(",") if u.strip()})
    return roles


def build_app(config: CloudConfig, worker_urls: list[str]) -> FastAPI:
    g = config.gateway

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        stores = open_stores(config)
        client = httpx.AsyncClient(timeout=httpx.Timeout(g.request_timeout_s, connect=g.connect_timeout_s),
                                   transport=ShardedTransport(httpx.Limits(
                                       max_connections=1024, max_keepalive_connections=128,
                                       keepalive_expiry=KEEPALIVE_EXPIRY_S)))
        roles = worker_roles(config, worker_urls)
        pool = WorkerPool(list(roles), client, config.server.api_key, g.health_interval_s, kind=g.worker_type,
                          roles=roles, metrics_interval_s=g.metrics_interval_s,
                          breaker_threshold=g.breaker_threshold, breaker_open_s=g.breaker_open_s)
        watcher = None
        if g.k8s_discovery:  # the pool follows the ready pods the selectors match
            from cloud_tier.gateway.workers.discovery import KubernetesDiscovery, follow

            discovery = KubernetesDiscovery(g.k8s_namespace, g.k8s_selector, g.k8s_prefill_selector,
                                            g.k8s_decode_selector, port=g.k8s_port)
            watcher = asyncio.create_task(follow(discovery, lambda found: pool.set_workers(
                {d.url: d.role for d in found}, {d.url: d.worker_type for d in found})))
            await _first_worker(pool, g.startup_timeout_s)
        await pool.start(wait_s=30.0)
        pool.decide_mode()
        if pool.foreign:
            names, max_len = await foreign_models(pool, g.startup_timeout_s)
            builder = None  # the body goes to the worker as it is: the worker's tokenizer is the one
            model_id, aliases, max_model_len = names[0], set(names[1:]), max_len
        else:
            model = await served_model(pool, g.startup_timeout_s)
            tokenizer = await asyncio.to_thread(tokenizer_files.load, model.tokenizer_files)
            builder = RequestBuilder(tokenizer, pool.max_model_len or model.max_model_len)
            model_id, aliases, max_model_len = model.model, set(model.aliases), builder.max_model_len
        app.state.service = GatewayService(g, pool, stores, builder, model_id, aliases, client,
                                           config.server.api_key)
        app.state.service.max_model_len = max_model_len
        collector = asyncio.create_task(_collect(stores.idempotency))
        app.state.batches = BatchStore(batch_db_path(g), limits=FileLimits(
            g.batch_tenant_max_bytes, g.batch_tenant_max_files, g.batch_file_ttl_s))
        runner = asyncio.create_task(BatchRunner(app.state.service, app.state.batches, RunnerConfig(
            concurrency=g.batch_concurrency, kv_share=g.batch_kv_share, online_busy=g.batch_online_busy,
            max_lines=g.batch_max_lines, backoff_s=g.batch_backoff_s, backoff_max_s=g.batch_backoff_max_s,
            max_refusals=g.batch_max_refusals, max_line_bytes=g.max_body_bytes)).run())
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
            await client.aclose()
            stores.close()

    app = build_openai_app("cascade cloud gateway", lifespan, config, "cloud", generation, ops, v1, admin,
                           batch_api)
    app.add_middleware(BodyLimit, limit=g.max_body_bytes,
                       routes={("POST", "/v1/files"): g.batch_max_file_bytes + UPLOAD_FORM_OVERHEAD})
    return app


class BodyLimit:
    """Every request body bounded while it arrives: a declared Content-Length over the route's
    limit is a 413 before a byte is read, and a body (chunked or not) that grows past it is a
    413 (raised from ``receive``, so the route stops reading there) - an upload is never read or
    spooled past its limit. ``routes``: (method, path) -> a limit of its own."""

    def __init__(self, app, limit: int, routes: dict[tuple[str, str], int]):
        self.app = app
        self.limit = limit
        self.routes = routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.routes.get((scope["method"], scope["path"]), self.limit)
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            err = body_too_large(limit)
            return await JSONResponse(err.body(), err.status, {"connection": "close"})(scope, receive, send)
        seen = 0

        async def bounded():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    raise body_too_large(limit)
            return message

        async def closing(message):  # past the limit: the connection closes, the rest is never read
            if message["type"] == "http.response.start" and seen > limit:
                message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
            await send(message)

        await self.app(scope, bounded, closing)


async def _collect(idem: IdempotencyRecords, every_s: float = 600.0) -> None:
    while True:
        with contextlib.suppress(Exception):
            n = await asyncio.to_thread(idem.collect_expired)
            if n:
                log.info("collected %d expired idempotency keys", n)
        await asyncio.sleep(every_s)
