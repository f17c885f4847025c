"""Thin handlers of the gateway: the OpenAI API for tenants, admin endpoints, health, metrics."""

from __future__ import annotations

import dataclasses

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, Field

import cascade
from cascade import errors
from cascade.embeddings import EmbeddingRequest
from cascade.openai_format import formatter_for
from cascade.protocol import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ModelCard, ModelList
from cascade.structured.contract import contract_off_loop
from cascade.web import RequestRoute, openapi, parse_body, read_json
from cascade.web.caller import CallerGone, while_connected
from cascade.web.requests import bearer_matches
from cloud_tier.gateway.http.render import respond
from cloud_tier.gateway.pipeline import embeddings as embeddings_pipeline
from cloud_tier.gateway.pipeline.service import GatewayService
from cloud_tier.gateway.tenants.keys import ApiKey
from cloud_tier.gateway.tenants.priority import HEADER as PRIORITY_HEADER
from cloud_tier.gateway.tenants.priority import priority_class
from cloud_tier.request_builder import deadline_seconds


def service(request: Request) -> GatewayService:
    return request.app.state.service


async def _key(request: Request, scope: str = "infer") -> ApiKey:
    return await service(request).authenticate(request.headers.get("authorization", ""), scope)


ops = APIRouter()  # health and metrics
# generation: most of the traffic; its handlers read their own bodies and answer a Response
generation = APIRouter(prefix="/v1", route_class=RequestRoute)
v1 = APIRouter(prefix="/v1")
admin = APIRouter(prefix="/v1/admin")
_GENERATION_ERRORS = openapi.errors(400, 401, 403, 404, 409, 413, 422, 429, 500, 502, 503)
_ADMIN_ERRORS = openapi.errors(401, 403, 500)


@ops.get("/healthz", responses=openapi.errors(503))
@ops.get("/health", responses=openapi.errors(503))
async def healthz(request: Request):
    svc = service(request)
    workers = {w.url: {"role": w.role, "type": w.kind, "healthy": w.healthy} for w in svc.pool.workers.values()}
    if not any(w.healthy for w in svc.pool.workers.values()):
        raise errors.APIError(503, "no healthy worker", "server_error", code="no_workers")
    return {"status": "ok", "tier": "cloud", "role": "gateway", "version": cascade.__version__,
            "model": svc.model_id, "workers": workers}


@ops.get("/metrics", response_class=PlainTextResponse, responses=openapi.errors(401))
async def metrics(request: Request):
    svc = service(request)
    # [gateway] metrics_key: a scraper must present it
    if svc.config.metrics_key and not bearer_matches(request, svc.config.metrics_key):
        raise errors.unauthorized("This gateway's /metrics needs its metrics key as a bearer token.")
    svc.metrics.refresh(svc.pool, svc.admission, svc.routing)
    return PlainTextResponse(generate_latest(svc.metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _card(request: Request) -> ModelCard:
    svc = service(request)
    meta = {"max_model_len": svc.max_model_len}
    identity = svc.own.builder.tokenizer_identity if svc.own.builder is not None else ""
    if identity:  # a device whose model has the same tokenizer may send its draft tokens (cascade.draft)
        meta["tokenizer"] = identity
    if svc.embedding_identity:  # a device embeds here only when its model's embeddings are these
        meta["embedding"] = svc.embedding_identity
    return ModelCard(id=svc.model_id, created=request.app.state.started, meta=meta)


@v1.get("/models", responses=openapi.errors(401, 403, 500))
async def list_models(request: Request) -> ModelList:
    await _key(request)
    return ModelList(data=[_card(request)])


@v1.get("/models/{model:path}", responses=openapi.errors(401, 403, 404, 500))
async def get_model(request: Request, model: str) -> ModelCard:
    await _key(request)
    service(request).check_model(model)
    return _card(request)


async def _serve(request: Request, endpoint: str, schema):
    svc = service(request)
    key = await _key(request)
    try:
        body = await read_json(request, svc.config.max_body_bytes)
        req = parse_body(schema, body)
        await contract_off_loop(req, endpoint)  # a bad response_format or tools: a 400 here, whichever worker serves
        svc.check_model(req.model)
        # the class is the gateway's, not the worker's: it leaves the body (a foreign worker gets none)
        klass = priority_class(request.headers.get(PRIORITY_HEADER), body.pop("priority_class", None))
        deadline = request.headers.get("x-cascade-deadline")
        deadline_s = None if deadline is None else deadline_seconds(deadline)
    except errors.APIError:
        svc.count(key.tenant, endpoint, "4xx")
        raise
    try:  # a client that leaves while its request waits (admission, a duplicate's result) is let go
        result = await while_connected(
            request, svc.begin(key, endpoint, body, req, request.headers.get("idempotency-key"),
                               request.headers.get("x-request-id"), klass, deadline_s))
    except CallerGone:
        return Response(status_code=499)
    return await respond(request, result, endpoint, req, lambda: formatter_for(endpoint, svc.model_id, req))


@generation.post("/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest),
                 responses={**openapi.generation(ChatCompletion, "chat.completion.chunk"), **_GENERATION_ERRORS})
async def chat_completions(request: Request):
    return await _serve(request, "chat", ChatCompletionRequest)


@generation.post("/completions", openapi_extra=openapi.body(CompletionRequest),
                 responses={**openapi.generation(Completion, "text_completion"), **_GENERATION_ERRORS})
async def completions(request: Request):
    return await _serve(request, "completions", CompletionRequest)


@v1.post("/embeddings", openapi_extra=openapi.body(EmbeddingRequest),
         responses=openapi.errors(400, 401, 403, 404, 413, 429, 500, 502, 503))
async def embeddings(request: Request) -> JSONResponse:
    """OpenAI's embeddings on one of the workers (ours, or a foreign one's passed through)."""
    svc = service(request)
    key = await _key(request)
    try:
        body = await read_json(request, svc.config.max_body_bytes)
    except errors.APIError:
        svc.count(key.tenant, "embeddings", "4xx")
        raise
    status, answer = await embeddings_pipeline.serve(svc, key, body)
    return JSONResponse(answer, status_code=status)


# -- admin (scope "admin"; a key manages its own tenant) --------------------------------------

class NewKey(BaseModel):
    device: str | None = None
    scopes: list[str] = ["infer"]
    rps: float = Field(0.0, ge=0)
    tpm: float = Field(0.0, ge=0)
    priority: int | None = None  # default: the creating key's; never ahead of it


def _key_json(k: ApiKey) -> dict:
    d = dataclasses.asdict(k)
    d["scopes"] = sorted(k.scopes)
    return d


@admin.get("/keys", responses=_ADMIN_ERRORS)
async def list_keys(request: Request):
    key = await _key(request, "admin")
    return {"object": "list", "data": [_key_json(k) for k in service(request).keys.list(key.tenant)]}


@admin.post("/keys", openapi_extra=openapi.body(NewKey), responses=openapi.errors(400, 401, 403, 413, 500))
async def create_key(request: Request):
    key = await _key(request, "admin")
    svc = service(request)
    new = parse_body(NewKey, await read_json(request, svc.config.max_body_bytes))
    priority = key.priority if new.priority is None else new.priority
    if priority < key.priority:
        raise errors.APIError(403, f"A key may not create a key that runs ahead of its own priority "
                              f"({key.priority}).", "permission_error", "priority", "priority_not_allowed")
    try:
        plaintext, record = svc.keys.create(key.tenant, new.device, new.scopes, new.rps, new.tpm, priority)
    except ValueError as e:
        raise errors.bad_request(str(e)) from e
    return {"key": plaintext, **_key_json(record)}


@admin.get("/workers", responses=_ADMIN_ERRORS)
async def workers(request: Request):
    await _key(request, "admin")
    svc = service(request)
    return {"object": "list", "data": [
        {"url": w.url, "role": w.role, "type": w.kind, "healthy": w.healthy, "committed_blocks": w.committed_blocks,
         "pending_prefill_tokens": w.pending_prefill_tokens, "in_flight": w.in_flight,
         "load": w.report.model_dump() if w.report else (dataclasses.asdict(w.foreign) if w.foreign else None),
         "breaker": w.breaker.state if w.breaker else "closed", "last_error": w.last_error}
        for w in svc.pool.workers.values()]}
