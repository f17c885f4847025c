"""Thin HTTP handlers of the edge agent's OpenAI-compatible API."""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

import cascade
from cascade.embeddings import EmbeddingRequest
from cascade.openai_format import formatter_for
from cascade.protocol import ChatCompletion, ChatCompletionRequest, Completion, CompletionRequest, ModelCard, ModelList
from cascade.structured.contract import contract_of
from cascade.web import openai_response, openapi, parse_body, read_json, require_api_key
from edge_agent.server import embeddings as embeddings_route
from edge_agent.server.escalation import Escalator, Queued
from edge_agent.server.service import EdgeService
from edge_agent.server.status_count import settle

log = logging.getLogger(__name__)


def service(request: Request) -> EdgeService:
    return request.app.state.service


def escalator(request: Request) -> Escalator:
    return request.app.state.escalator


ops = APIRouter()  # health and metrics
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])
# what a generation can answer: its own refusals, and the cloud's 4xx passed on when it escalates
_GENERATION = {**openapi.queued(), **openapi.errors(400, 401, 403, 404, 409, 413, 422, 429, 500, 503)}


@ops.get("/healthz")
@ops.get("/health")
async def healthz(request: Request, sha256: bool = False):
    """``?sha256=1``: hash the served GGUF (once, in the background) for ``model_sha256``."""
    svc = service(request)
    esc = escalator(request)
    up = esc.upstream
    q = await asyncio.to_thread(esc.outbox.queue.pending)
    return {"status": "ok", "tier": "edge", "version": cascade.__version__, "model": svc.model_id,
            "queue": {"pending": q["items"], "pending_bytes": q["bytes"], "oldest_pending_age_s": q["oldest_age_s"]},
            "slots": {"total": svc.pool.size, "busy": svc.pool.busy, "waiting": svc.pool.waiting},
            "upstream": None if up is None else {"url": up.base_url, "circuit": up.breaker.state,
                                                 "retry_after_s": round(up.breaker.retry_after_s(), 3),
                                                 "last_error": up.breaker.last_error or None},
            "model_sha256": esc.gate.sha256(wait=False) if sha256 else esc.gate.known_sha256,
            "router": esc.gate.status(esc.policy.router)}


@ops.get("/metrics", response_class=PlainTextResponse)
async def metrics(request: Request):
    return PlainTextResponse(generate_latest(service(request).metrics.registry),
                             media_type=CONTENT_TYPE_LATEST)


async def _model_card(request: Request) -> ModelCard:
    svc = service(request)
    d = svc.description
    embedding = await request.app.state.embeddings.identity(d)  # hashed once per file (a sidecar keeps it)
    return ModelCard(id=svc.model_id, created=request.app.state.started,
                     meta={"format": d.format, "quantization": d.quantization, "n_ctx": d.n_ctx,
                           "architecture": d.architecture, "chat_template": d.chat_template,
                           **({"tokenizer": d.tokenizer} if d.tokenizer else {}),
                           **({"embedding": embedding} if embedding else {})})


@v1.get("/models", responses=openapi.errors(401, 500))
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[await _model_card(request)])


@v1.get("/models/{model:path}", responses=openapi.errors(401, 404, 500))
async def get_model(request: Request, model: str) -> ModelCard:
    service(request).check_model(model)
    return await _model_card(request)


@v1.post("/embeddings", openapi_extra=openapi.body(EmbeddingRequest),
         responses=openapi.errors(400, 401, 404, 409, 413, 500, 503))
async def embeddings(request: Request):
    """OpenAI's embeddings, on this device's model or (asked, same model) in the cloud."""
    return await embeddings_route.serve(request)


@v1.post("/chat/completions", openapi_extra=openapi.body(ChatCompletionRequest),
         responses={**openapi.generation(ChatCompletion, "chat.completion.chunk"), **_GENERATION})
async def chat_completions(request: Request):
    return await _serve(request, "chat", ChatCompletionRequest,
                        lambda svc, req, contract: svc.chat_job(req, contract),
                        lambda req: "\n".join(m.text() for m in req.messages))


@v1.post("/completions", openapi_extra=openapi.body(CompletionRequest),
         responses={**openapi.generation(Completion, "text_completion"), **_GENERATION})
async def completions(request: Request):
    return await _serve(request, "completions", CompletionRequest,
                        lambda svc, req, contract: svc.completion_job(req, contract),
                        lambda req: req.prompt if isinstance(req.prompt, str) else "")


async def _serve(request: Request, endpoint: str, schema, make_job, prompt_text):
    """Parse, route (edge, cloud or queue) and answer one OpenAI request."""
    svc = service(request)
    body = await read_json(request, request.app.state.config.server.max_body_bytes)
    req = parse_body(schema, body)
    shape = contract_of(req, endpoint)
    svc.check_model(req.model)
    routed = await escalator(request).route(req, endpoint, body, lambda: make_job(svc, req, shape), prompt_text(req),
                                            _session(request, req), request.headers.get("idempotency-key"), shape)
    if isinstance(routed, Queued):
        return JSONResponse(routed.body(), status_code=202, headers=routed.headers)
    fmt = formatter_for(endpoint, routed.model or svc.model_id, req)
    fmt.cascade = routed.cascade_field
    # answers are counted by status in one place (status_count.CountAnswers); a stream's end is told it
    events = request.app.state.drain.guard(routed.events)  # SIGTERM: ends in-band at the drain's deadline
    resp = await openai_response(request, events, fmt, req.stream, req.include_usage_in_stream(),
                                 lambda status: settle(request, status))
    resp.headers.update(routed.headers)
    return resp


@v1.get("/requests/{request_id}", responses=openapi.errors(401, 404, 500))
async def queued_request(request: Request, request_id: str):
    """A queued request's state: queued | sending | done (with the cloud's response) | failed | expired."""
    return await escalator(request).outbox.status(request_id)


def _session(request: Request, req) -> str | None:
    """What orders queued requests: ``cascade.session``, else X-Cascade-Session, else ``user``."""
    opts = req.cascade
    return (opts.session if opts else None) or request.headers.get("x-cascade-session") or req.user

