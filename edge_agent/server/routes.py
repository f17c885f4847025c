"""Thin HTTP handlers of the edge agent's OpenAI-compatible API."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from cascade.api import openai_response, parse_body, read_json, require_api_key
from cascade.openai_format import ChatFormatter, CompletionFormatter
from cascade.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from edge_agent.server.service import EdgeService, Job

log = logging.getLogger(__name__)


def service(request: Request) -> EdgeService:
    return request.app.state.service


router = APIRouter()
v1 = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)])


@router.get("/healthz")
@router.get("/health")
async def healthz(request: Request):
    svc = service(request)
    return {"status": "ok", "tier": "edge", "model": svc.model_id,
            "slots": {"total": svc.pool.size, "busy": svc.pool.busy, "waiting": svc.pool.waiting}}


@router.get("/metrics")
async def metrics(request: Request):
    return PlainTextResponse(generate_latest(service(request).metrics.registry),
                             media_type=CONTENT_TYPE_LATEST)


def _model_card(request: Request) -> ModelCard:
    svc = service(request)
    d = svc.description
    return ModelCard(id=svc.model_id, created=request.app.state.started,
                     meta={"format": "gguf", "quantization": d.quantization, "n_ctx": d.n_ctx,
                           "architecture": d.architecture, "chat_template": d.chat_template})


@v1.get("/models")
async def list_models(request: Request) -> ModelList:
    return ModelList(data=[_model_card(request)])


@v1.get("/models/{model:path}")
async def get_model(request: Request, model: str) -> ModelCard:
    service(request).check_model(model)
    return _model_card(request)


@v1.post("/chat/completions")
async def chat_completions(request: Request):
    svc = service(request)
    req = parse_body(ChatCompletionRequest, await read_json(request, request.app.state.config.server.max_body_bytes))
    job = svc.chat_job(req)
    fmt = ChatFormatter(svc.model_id, req.logprobs)
    return await _respond(request, svc, job, fmt, "chat", req.stream, req.include_usage_in_stream())


@v1.post("/completions")
async def completions(request: Request):
    svc = service(request)
    req = parse_body(CompletionRequest, await read_json(request, request.app.state.config.server.max_body_bytes))
    job = svc.completion_job(req)
    fmt = CompletionFormatter(svc.model_id, req.logprobs)
    return await _respond(request, svc, job, fmt, "completions", req.stream, req.include_usage_in_stream())


async def _respond(request: Request, svc: EdgeService, job: Job, fmt, endpoint: str, stream: bool,
                   include_usage: bool):
    reservation = svc.admit()  # 429 now, before any byte of a response is sent

    def count(status: str) -> None:
        svc.metrics.requests.labels(endpoint=endpoint, status=status).inc()

    return await openai_response(request, svc.run(job, reservation), fmt, stream, include_usage, count)
